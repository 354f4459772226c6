"""vLLM's scheduler output -> the runner's batches, without vLLM (stand-ins for its dataclasses).

These run in the main tier: the translation is plain Python. The `vllm`-marked tests drive the
same code through the real vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from runner_fsm.config import GraphMode
from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.errors import RequestStateError
from runner_fsm.integrations.vllm.options import WorkerOptions, runner_config
from runner_fsm.integrations.vllm.requests import PAD_BLOCK, RequestTable
from runner_fsm.integrations.vllm.schema import called_names


def new_req(rid, prompt, blocks, computed=0):
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(prompt), block_ids=(list(blocks),),
                           num_computed_tokens=computed)


def cached(rows=(), resumed=()):
    rows = list(rows)
    return SimpleNamespace(req_ids=[r[0] for r in rows], resumed_req_ids=set(resumed),
                           new_block_ids=[r[2] for r in rows], num_computed_tokens=[r[1] for r in rows],
                           num_output_tokens=[r[3] for r in rows])


def sched(new=(), cache=None, scheduled=None, spec=None, finished=()):
    scheduled = dict(scheduled or {})
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cache or cached(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens=dict(spec or {}), finished_req_ids=set(finished),
                           kv_cache_block_copies=None)


def test_chunked_prefill_then_decode_keeps_only_completing_samples():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", range(10, 20), [4]), new_req("b", [7, 8, 9], [5])], scheduled={"a": 6, "b": 3})
    table.update(so)
    plan = table.plan(so)
    assert plan.batch.req_ids == ("a", "b")
    assert plan.emits == (False, True)  # a's chunk stops short of its prompt's end
    assert plan.batch.is_prefilling.tolist() == [True, True]
    assert plan.batch.token_ids.tolist() == [10, 11, 12, 13, 14, 15, 7, 8, 9]
    assert table.commit(plan, {"a": [99], "b": [42]}) == [[], [42]]

    so = sched(cache=cached([("a", 6, None, 0), ("b", 3, None, 1)]), scheduled={"a": 4, "b": 1})
    table.update(so)
    plan = table.plan(so)
    assert plan.emits == (True, True)
    assert plan.batch.is_prefilling.tolist() == [True, False]
    assert plan.batch.num_computed.tolist() == [6, 3]
    assert plan.batch.token_ids.tolist() == [16, 17, 18, 19, 42]
    assert table.commit(plan, {"a": [5], "b": [6]}) == [[5], [6]]
    assert table.requests["b"].tokens == [7, 8, 9, 42, 6]


def test_blocks_append_and_are_replaced_on_resume():
    table = RequestTable(drafting=False)
    table.update(sched(new=[new_req("a", range(3, 7), [1])], scheduled={"a": 4}))
    table.update(sched(cache=cached([("a", 4, ([2],), 0)]), scheduled={"a": 1}))
    assert table.requests["a"].block_ids == [1, 2]
    table.update(sched(cache=cached([("a", 0, ([8, 9],), 0)], resumed={"a"}), scheduled={"a": 4}))
    assert table.requests["a"].block_ids == [8, 9] and table.num_resumed == 1


def test_resumed_request_recomputes_prompt_and_outputs():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", [3, 4, 5], [1])], scheduled={"a": 3})
    table.update(so)
    table.commit(table.plan(so), {"a": [6]})
    so = sched(cache=cached([("a", 3, None, 1)]), scheduled={"a": 1})
    table.update(so)
    table.commit(table.plan(so), {"a": [7]})
    so = sched(cache=cached([("a", 0, ([2],), 2)], resumed={"a"}), scheduled={"a": 5})
    table.update(so)
    plan = table.plan(so)
    assert plan.batch.token_ids.tolist() == [3, 4, 5, 6, 7] and plan.emits == (True,)
    assert plan.batch.is_prefilling.tolist() == [True]


def test_scheduler_dropping_outputs_truncates_known_tokens():
    table = RequestTable(drafting=False)
    table.update(sched(new=[new_req("a", [3, 4], [1])], scheduled={"a": 2}))
    table.requests["a"].tokens += [10, 11, 12]
    table.update(sched(cache=cached([("a", 3, None, 1)]), scheduled={"a": 1}))
    assert table.requests["a"].tokens == [3, 4, 10]


def test_drafts_ride_on_decode_rows_and_tables_pad_with_invalid_blocks():
    table = RequestTable(drafting=True)
    so = sched(new=[new_req("a", [3, 4, 5], [1]), new_req("b", range(3, 40), [2, 3])], scheduled={"a": 3, "b": 37})
    table.update(so)
    plan = table.plan(so)
    assert plan.batch.block_tables.tolist() == [[1, PAD_BLOCK], [2, 3]]  # the drafter stops at -1
    assert plan.batch.num_draft_tokens.tolist() == [0, 0]
    table.commit(plan, {"a": [6], "b": [7]})
    so = sched(cache=cached([("a", 3, None, 1), ("b", 37, None, 1)]), scheduled={"a": 3, "b": 1},
               spec={"a": [8, 9]})
    table.update(so)
    plan = table.plan(so)
    assert plan.batch.token_ids.tolist() == [6, 8, 9, 7]
    assert plan.batch.num_draft_tokens.tolist() == [2, 0]
    assert plan.batch.num_scheduled.tolist() == [3, 1]
    assert table.commit(plan, {"a": [8, 1, 2], "b": [3]}) == [[8, 1, 2], [3]]


def test_finished_requests_are_forgotten_and_unknown_ones_are_named():
    table = RequestTable(drafting=False)
    table.update(sched(new=[new_req("a", [3, 4], [1])], scheduled={"a": 2}))
    table.update(sched(finished={"a"}))
    assert len(table) == 0
    with pytest.raises(RequestStateError, match="'a'"):
        table.update(sched(cache=cached([("a", 2, None, 0)]), scheduled={"a": 1}))


def test_schedule_beyond_known_tokens_is_a_state_error():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", [3, 4], [1])], scheduled={"a": 5})
    table.update(so)
    with pytest.raises(RequestStateError, match="knows 2 tokens"):
        table.plan(so)


def test_more_than_one_kv_cache_group_is_refused():
    table = RequestTable(drafting=False)
    req = new_req("a", [3, 4], [1])
    req.block_ids = ([1], [2])
    with pytest.raises(RequestStateError, match="2 KV cache groups"):
        table.update(sched(new=[req], scheduled={"a": 2}))


def _vllm_config(**additional):
    return SimpleNamespace(
        additional_config={"runner_fsm": additional} if additional else {},
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE"), cudagraph_capture_sizes=[]),
        parallel_config=SimpleNamespace(data_parallel_size=2, prefill_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=8),
        model_config=SimpleNamespace(max_model_len=500),
        speculative_config=SimpleNamespace(num_speculative_tokens=2, method="draft_model"),
    )


def test_options_come_from_additional_config_then_environment():
    opts = WorkerOptions.from_vllm(_vllm_config(graph_mode="full_decode_only", capture_sizes=[1, 2, 128]),
                                   environ={"RUNNER_FSM_RUN_DIR": "/tmp/x", "RUNNER_FSM_CHUNKING": "balanced"})
    assert opts.graph_mode is GraphMode.FULL_DECODE_ONLY and opts.run_dir == "/tmp/x"
    assert opts.chunking == "balanced" and opts.capture_sizes == (1, 2, 128)
    cfg = runner_config(_vllm_config(), opts, block_size=32)
    assert cfg.capture_sizes == (1, 2)  # capture sizes above the token budget are dropped
    assert cfg.layout.dp_size == 2 and cfg.num_speculative_tokens == 2
    assert cfg.max_blocks_per_req == -(-(500 + 2) // 32) and cfg.max_num_tokens == 64
    with pytest.raises(ConfigError, match="unknown keys"):
        WorkerOptions.from_vllm(_vllm_config(rundir="typo"), environ={})


def test_called_names_reads_rpc_and_direct_calls():
    text = 'self.collective_rpc("execute_dummy_batch")\nself.collective_rpc(\n  "sample_tokens", args=x)\nworker.load_model()'
    assert called_names([text]) == {"execute_dummy_batch", "sample_tokens", "load_model"}


def test_plan_block_tables_are_int64_rows():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", [3, 4], [1]), new_req("b", range(3, 70), [2, 3, 4])], scheduled={"a": 2, "b": 67})
    table.update(so)
    tables = table.plan(so).batch.block_tables
    assert tables.dtype == np.int64 and tables.tolist() == [[1, PAD_BLOCK, PAD_BLOCK], [2, 3, 4]]


def test_finished_ids_and_prefix_hits_reach_the_next_real_batch():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", [3, 4], [1]), new_req("b", [5, 6], [2])], scheduled={"a": 2, "b": 2})
    table.update(so)
    assert table.plan(so).batch.finished_req_ids == ()
    table.update(sched(finished={"a"}))  # a step with no tokens: nothing runs, the id waits
    so = sched(new=[new_req("c", list(range(3, 40)), [3, 4], computed=32)], finished={"b"},
               cache=cached([]), scheduled={"c": 5})
    table.update(so)
    plan = table.plan(so)
    assert sorted(plan.batch.finished_req_ids) == ["a", "b"]
    assert plan.batch.cached_prefix_req_ids == ("c",) and table.num_prefix_hits == 1
    table.commit(plan, {"c": [9]})
    so = sched(cache=cached([("c", 37, None, 1)]), scheduled={"c": 1})
    table.update(so)
    batch = table.plan(so).batch
    assert batch.finished_req_ids == () and batch.cached_prefix_req_ids == ()


def test_an_aborted_id_resubmitted_in_the_same_step_is_not_reported_finished():
    table = RequestTable(drafting=False)
    so = sched(new=[new_req("a", [3, 4], [1])], scheduled={"a": 2})
    table.update(so)
    table.plan(so)
    so = sched(new=[new_req("a", [7, 8, 9], [2])], finished={"a"}, scheduled={"a": 3})
    table.update(so)
    batch = table.plan(so).batch
    assert batch.finished_req_ids == () and batch.token_ids.tolist() == [7, 8, 9]
