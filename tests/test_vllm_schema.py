"""FSMWorker against the installed vLLM's names, and what it refuses (no engine is started)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import SimpleNamespace

import pytest

from runner_fsm.integrations.vllm.common import schema
from runner_fsm.integrations.vllm.common.errors import UnsupportedFeatureError, VLLMSchemaError

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
    from vllm_harness import FSM_WORKER

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
                             _dummy_run=print, _prepare_inputs=print, intermediate_tensors=None,
                             max_num_tokens=64, model_config=object(), device="cpu")
    adapter = V1Runner(runner)
    assert adapter.problems() == ["SimpleNamespace.seq_lens is missing (v1 runner)"]
    with pytest.raises(VLLMSchemaError, match=r"SimpleNamespace.seq_lens is missing \(v1 runner\)"):
        schema.check_runner(adapter)


@pytest.mark.parametrize("sizes", [(1, 1, 1, 2), (2, 1, 2, 2), (2, 2, 1, 2), (3, 1, 2, 1)])
def test_every_rank_is_placed_where_vllm_numbers_it(sizes):
    """`rank_place` against vLLM's own layout (`all_ranks.reshape(-1, dp, pp, pcp, tp)` in
    `initialize_model_parallel`, as the installed source writes it): every worker's global rank
    and coordinates. Mutation seen failing: PCP as the fastest dimension (`rank % pcp_size`,
    the rule before TP was supported)."""
    import torch
    from vllm.distributed import parallel_state as ps

    from runner_fsm.integrations.vllm.rundir import rank_place

    assert "all_ranks = torch.arange(world_size).reshape(" in inspect.getsource(ps.initialize_model_parallel)
    dp, pp, pcp, tp = sizes
    layout = torch.arange(dp * pp * pcp * tp).reshape(-1, dp, pp, pcp, tp)[0]
    for d in range(dp):
        for rank in range(pp * pcp * tp):  # the `rank` vLLM hands each worker of replica d
            par = SimpleNamespace(data_parallel_size=dp, pipeline_parallel_size=pp, prefill_context_parallel_size=pcp,
                                  tensor_parallel_size=tp, decode_context_parallel_size=1, data_parallel_rank=d)
            place = rank_place(SimpleNamespace(parallel_config=par), rank)
            assert layout[tuple(place.coords)].item() == place.global_rank == d * pp * pcp * tp + rank
