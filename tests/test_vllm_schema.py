"""FSMWorker against the installed vLLM's names, and what it refuses (no engine is started)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import SimpleNamespace

import pytest

from runner_fsm.integrations.vllm import schema
from runner_fsm.integrations.vllm.errors import UnsupportedFeatureError, VLLMSchemaError

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def fsm_worker():
    from runner_fsm.integrations.vllm import FSMWorker

    return FSMWorker


def test_fsm_worker_wraps_the_platform_worker():
    from vllm.v1.worker.cpu_worker import CPUWorker

    worker = fsm_worker()
    assert worker.__mro__[2] is CPUWorker  # FSMWorker -> mixin -> vLLM's own CPU worker
    assert f"{worker.__module__}.{worker.__qualname__}" == h_worker_name()


def h_worker_name() -> str:
    from runner_fsm.integrations.vllm.harness import FSM_WORKER

    return FSM_WORKER


def test_installed_vllm_has_every_name_the_worker_uses():
    assert schema.find_problems(fsm_worker()) == []


def test_a_missing_field_is_refused_naming_the_vllm_version_and_the_name():
    import vllm

    def lookup(path):
        obj = schema.resolve(path)
        if path.endswith("CachedRequestData"):
            fields = [(f.name, f.type) for f in dataclasses.fields(obj) if f.name != "resumed_req_ids"]
            return dataclasses.make_dataclass("CachedRequestData", fields)
        return obj

    with pytest.raises(VLLMSchemaError) as err:
        schema.check_schema(fsm_worker(), lookup=lookup)
    message = str(err.value)
    assert f"installed vLLM {vllm.__version__}" in message
    assert "vllm.v1.core.sched.output.CachedRequestData.resumed_req_ids is missing" in message


def test_a_missing_symbol_is_refused_by_name():
    def lookup(path):
        if path == "vllm.forward_context.get_forward_context":
            raise AttributeError(path)
        return schema.resolve(path)

    assert schema.find_problems(fsm_worker(), lookup=lookup) == [
        "vllm.forward_context.get_forward_context is missing"]


def test_a_renamed_worker_call_is_refused():
    sources = [inspect.getsource(importlib.import_module(m)).replace("execute_dummy_batch", "run_idle_batch")
               for m in schema.CALLER_MODULES]
    assert schema.find_problems(fsm_worker(), sources=sources) == [
        "vLLM no longer calls worker method 'execute_dummy_batch' (renamed?)"]


def test_a_platform_worker_without_an_overridden_method_is_refused():
    import vllm.v1.worker.gpu_worker as gpu_worker

    saved = gpu_worker.Worker.take_draft_token_ids
    try:  # as in a vLLM whose worker no longer has the method FSMWorker wraps
        del gpu_worker.Worker.take_draft_token_ids
        assert schema.find_problems(fsm_worker()) == ["CPUWorker.take_draft_token_ids is missing"]
    finally:
        gpu_worker.Worker.take_draft_token_ids = saved


def test_a_runner_without_a_persistent_buffer_is_refused():
    from runner_fsm.integrations.vllm.runners.v1 import V1Runner

    table = SimpleNamespace(block_table=object(), slot_mapping=object())
    runner = SimpleNamespace(model=object(), input_ids=object(), positions=object(), query_start_loc=object(),
                             max_num_reqs=8, input_batch=SimpleNamespace(num_reqs=0, block_table=[table]),
                             parallel_config=object(), _determine_batch_execution_and_padding=print,
                             _dummy_run=print, _prepare_inputs=print)
    adapter = V1Runner(runner)
    assert adapter.problems() == ["SimpleNamespace.seq_lens is missing (v1 runner)"]
    with pytest.raises(VLLMSchemaError, match=r"SimpleNamespace.seq_lens is missing \(v1 runner\)"):
        schema.check_runner(adapter)


def test_tensor_parallelism_is_refused_by_name():
    from runner_fsm.integrations.vllm.rundir import replica_coords

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                                             data_parallel_rank=0))
    with pytest.raises(UnsupportedFeatureError, match="tensor_parallel_size=2"):
        replica_coords(config, 0)
