"""FSMWorker against the installed vLLM's schema, and what it refuses (no engine is started)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from runner_fsm.integrations.vllm import FSMWorker, schema  # noqa: E402
from runner_fsm.integrations.vllm.admission import check_request  # noqa: E402
from runner_fsm.integrations.vllm.errors import UnsupportedRequestError, VLLMSchemaError  # noqa: E402


def test_installed_vllm_matches_the_worker():
    assert schema.find_problems(FSMWorker) == []


def test_a_missing_field_fails_at_start_up_naming_the_vllm_version():
    def lookup(path):
        obj = schema.resolve(path)
        if path.endswith("CachedRequestData"):
            fields = [(f.name, f.type) for f in dataclasses.fields(obj) if f.name != "resumed_req_ids"]
            return dataclasses.make_dataclass("CachedRequestData", fields)
        return obj

    with pytest.raises(VLLMSchemaError) as err:
        schema.check_schema(FSMWorker, lookup=lookup)
    message = str(err.value)
    assert f"installed vLLM {vllm.__version__}" in message and "['resumed_req_ids']" in message


def test_a_renamed_worker_call_fails_at_start_up():
    import importlib
    import inspect

    sources = [inspect.getsource(importlib.import_module(m)).replace("execute_dummy_batch", "run_idle_batch")
               for m in schema.CALLER_MODULES]
    problems = schema.find_problems(FSMWorker, sources=sources)
    assert problems == ["vLLM no longer calls worker method 'execute_dummy_batch' (renamed?)"]


def _new(params, **extra):
    base = dict(req_id="r7", prompt_token_ids=[3, 4], sampling_params=params, pooling_params=None,
                lora_request=None, prompt_embeds=None, mm_features=[])
    return SimpleNamespace(**{**base, **extra})


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=0.8), "temperature=0.8"),
    (SamplingParams(temperature=0, repetition_penalty=1.2), "repetition_penalty=1.2"),
    (SamplingParams(temperature=0, logprobs=2), "logprobs=2"),
    (SamplingParams(temperature=0, min_tokens=3), "min_tokens=3"),
    (SamplingParams(temperature=0, logit_bias={5: 1.0}), "logit_bias"),
])
def test_non_greedy_requests_are_refused_by_name(params, field):
    with pytest.raises(UnsupportedRequestError, match=rf"request 'r7'.*{field}"):
        check_request(_new(params))


def test_plain_greedy_requests_are_admitted():
    check_request(_new(SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    check_request(_new(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)))
