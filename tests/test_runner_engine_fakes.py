"""The embedded engine with fakes: named by the caller, never imported by production code."""

import pytest

from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import synthetic_requests
from runner_fsm.errors import ConfigError

FAKES = "runner_fsm.testing.fakes:engine_model_and_drafter"


def test_engine_runs_the_fakes_named_by_model_factory(tmp_path):
    requests = synthetic_requests(3, vocab_size=64, max_new_tokens=4, seed=3)
    cfg = EngineConfig(model_dir=None, model_factory=FAKES, run_dir=str(tmp_path), num_speculative_tokens=1)
    result = run_engine(cfg, requests, in_process=True, timeout_s=120)
    assert result.ok, [r.error for r in result.errors]
    assert sorted(result.outputs) == sorted(r.req_id for r in requests)
    assert all(len(tokens) == 4 for tokens in result.outputs.values())


def test_engine_without_model_or_factory_is_refused_with_the_reason(tmp_path):
    cfg = EngineConfig(model_dir=None, run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"needs a model directory \(model_dir\) or a model_factory"):
        run_engine(cfg, synthetic_requests(1, vocab_size=64), in_process=True, timeout_s=60)
    assert not list(tmp_path.glob("rank-*.jsonl"))  # refused before any rank started
