"""Greedy outputs of the embedded engine do not depend on DP, PCP, graphs or drafting.

The workload pins a long prompt and several decodes to replica 0 and one short request to
replica 1, so replica 1 goes idle (dummy steps, graph replays of dummies) while replica 0
still prefills and decodes. Outputs are compared, token for token, with DP=1 x PCP=1,
eager, no drafting, in float64.
"""

import itertools

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.config import GraphMode, ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request, outputs_equal

pytestmark = pytest.mark.multiproc


def _workload(vocab: int = 512) -> list[Request]:
    prompt = lambda n, s: tuple((7 * i + s) % (vocab - 3) + 3 for i in range(n))
    return [
        Request("long", prompt(70, 1), 12, arrival_step=0, replica=0),
        Request("mid", prompt(23, 2), 10, arrival_step=1, replica=0),
        Request("late", prompt(9, 3), 6, arrival_step=8, replica=0),
        Request("short", prompt(5, 4), 2, arrival_step=0, replica=1),
    ]


def _run(models, tmp_path, dp, pcp, k, mode, dtype="float64"):
    target, draft = models
    cfg = EngineConfig(model_dir=target, draft_dir=draft, layout=ParallelLayout(dp, pcp),
                       num_speculative_tokens=k, graph_mode=mode, dtype=dtype,
                       token_budget=32, capture_sizes=(1, 2, 4, 8, 16, 32),
                       run_dir=str(tmp_path / f"dp{dp}-pcp{pcp}-k{k}-{mode.value}"))
    requests = [Request(r.req_id, r.prompt, r.max_new_tokens, r.arrival_step,
                        None if r.replica is None else r.replica % dp) for r in _workload()]
    result = run_engine(cfg, requests, timeout_s=240)
    assert result.ok, [r.error for r in result.errors]
    report = replay(cfg.run_dir)  # every run of the matrix is sound offline too
    assert report.sound, report.format()
    return result


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    return _run(models, tmp_path_factory.mktemp("ref"), 1, 1, 0, GraphMode.NONE).outputs


def _check(models, tmp_path, reference, dp, pcp, k, mode):
    result = _run(models, tmp_path, dp, pcp, k, mode)
    assert outputs_equal(reference, result.outputs) == []
    if dp == 2:  # replica 1 really went idle while replica 0 worked
        idle = [r for r in result.ranks if r.dp_rank == 1 and r.pcp_rank == 0][0]
        assert idle.num_handoffs >= 1 and idle.steps_per_state.get("idle_dummy", 0) > 3
    return result


@pytest.mark.parametrize("k, mode", [(2, GraphMode.NONE), (0, GraphMode.FULL_DECODE_ONLY)])
def test_dp2_pcp2_matches_single_replica(models, tmp_path, reference, k, mode):
    _check(models, tmp_path, reference, 2, 2, k, mode)


@pytest.mark.slow
@pytest.mark.parametrize("dp, pcp, k, mode", [
    combo for combo in itertools.product((1, 2), (1, 2), (0, 2), (GraphMode.NONE, GraphMode.FULL_DECODE_ONLY))
    if combo != (1, 1, 0, GraphMode.NONE)
])
def test_full_matrix(models, tmp_path, reference, dp, pcp, k, mode):
    _check(models, tmp_path, reference, dp, pcp, k, mode)
