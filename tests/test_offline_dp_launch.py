"""The offline DP launcher's process design (`integrations/vllm/offline_dp.py`), under a stand-in
vLLM (tests/fake_vllm_site) that records who imports it: vLLM is imported once, by the process
that forks the ranks; each rank is its fork and sees its own `VLLM_DP_RANK`; a rank that raises
ends with code 1 and its traceback in its own log while the others end with 0; jobs run one after
another in the same ranks. (The real thing runs in every offline DP test of the vLLM tiers.) In
the V1 leg of the vLLM tier, once: the launcher watches the ranks' process trees with psutil,
vLLM's dependency, which the package's own venv does not hold.

Mutation seen to fail it: one `python -m ... SPEC RANK` interpreter per rank, as before (three
imports of vLLM, each rank's parent the launcher).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner_fsm.integrations.vllm.offline_dp import Job, launch_dp

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

SITE = Path(__file__).resolve().parent / "fake_vllm_site"
PROBE = "dp_probe:serve"


def _launch(tmp_path: Path, per_rank_jobs: list[list], dp: int):
    imports = tmp_path / "imports"
    env = {"PYTHONPATH": os.pathsep.join([str(SITE), str(Path.cwd())]), "FAKE_VLLM_IMPORTS": str(imports)}
    jobs = [Job({"model": f"m{j}"}, per_rank, run=PROBE) for j, per_rank in enumerate(per_rank_jobs)]
    result = launch_dp(jobs, dp_size=dp, cwd=str(tmp_path), timeout_s=120, env=env)
    return result, [int(pid) for pid in imports.read_text().split()] if imports.exists() else []


def test_ranks_are_forks_of_one_process_that_imported_vllm_once(tmp_path):
    per_rank = [[(f"r{rank}", (rank, 7), 1)] for rank in range(3)]
    result, imports = _launch(tmp_path, [per_rank, per_rank], dp=3)
    assert result.codes == [0, 0, 0], result.logs
    seen = [extra for job in result.extra for extra in job]  # [job][rank]
    assert len(imports) == 1 and imports[0] not in {s["pid"] for s in seen}  # the forking process's alone
    assert {s["ppid"] for s in seen} == {imports[0]} and os.getpid() not in {s["ppid"] for s in seen}
    for job in result.extra:
        assert [(s["dp_rank"], s["dp_rank_local"], s["dp_size"]) for s in job] == [(str(r), str(r), "3") for r in range(3)]
        assert len({s["port"] for s in job}) == 1  # one master port a job
    assert [s["pid"] for s in result.extra[0]] == [s["pid"] for s in result.extra[1]]  # jobs share the ranks
    assert result.extra[0][0]["port"] != result.extra[1][0]["port"]  # each job on a fresh port
    assert all(s["cwd"] == str(tmp_path) for s in seen)
    assert result.outputs[0] == [{f"r{rank}": [rank, 7]} for rank in range(3)]
    for rank in range(3):
        assert result.logs[rank].count(f"probe on rank {rank}") == 2 and "probe on rank" not in \
            result.logs[rank].replace(f"probe on rank {rank}", "")  # each rank's output in its own log


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_raises_ends_with_code_1_and_its_traceback_the_others_with_0(tmp_path, failing):
    per_rank = [[("raise" if rank == failing else f"r{rank}", (1,), 1)] for rank in range(2)]
    result, imports = _launch(tmp_path, [per_rank], dp=2)
    assert result.codes == [1 if rank == failing else 0 for rank in range(2)], result.logs
    assert "RuntimeError: the probe's fault on this rank" in result.logs[failing]
    assert "RuntimeError" not in result.logs[1 - failing]
    assert all(at == at for at in result.ended_at)  # each rank's end seen (NaN: never)
    assert result.outputs[0][failing] is None and result.outputs[0][1 - failing] == {f"r{1 - failing}": [1]}
    assert len(imports) == 1


def test_a_vllm_that_cannot_be_imported_starts_no_rank_and_the_log_says_why(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(SITE), str(Path.cwd())])}  # no FAKE_VLLM_IMPORTS: its import raises
    result = launch_dp([Job({"model": "m"}, [[("r0", (1,), 1)], [("r1", (1,), 1)]], run=PROBE)], dp_size=2,
                       cwd=str(tmp_path), timeout_s=60, env=env)
    assert result.codes == [None, None] and result.outputs == [[None, None]]
    assert all("KeyError: 'FAKE_VLLM_IMPORTS'" in log for log in result.logs)  # the forking process's error, in each
