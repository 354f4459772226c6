"""Nothing outside the run directory, through vLLM (Part 28): an offline FSMWorker job killed whole
(SIGKILL to its process group, as vLLM kills its engine cores and workers) at five moments leaves
no entry in TMPDIR or /dev/shm of its making.

vLLM's default process layout (the engine core in a process of its own, with the engine-stop
plugin, `engine_stops`), TP=2 with `consensus` (the replica's two workers set up a shared-memory
exchange, `shm_exchange`); killed (`outside_driver`) once the engine core has started its workers,
with a worker held inside the exchange's set-up, mid-run, inside vLLM's shutdown of the workers,
and after a stop request's record. TMPDIR is an empty directory, /dev/shm a fresh tmpfs of the
job's own mount namespace. vLLM's own files are kept out by configuration where it has one (its
ZMQ sockets in VLLM_RPC_BASE_PATH, a directory of the test's); what vLLM itself still leaves,
killed so, is excluded by exactly its names and printed (`VLLM_LEAVES`): in TMPDIR its CPU TP
communicator's `vllm_dist_*` files and torch inductor's cache (`torchinductor_<user>`: vLLM
compiles its TP vocabulary masking; TORCHINDUCTOR_CACHE_DIR did not move it), in /dev/shm the
same communicator's buffers (`vllm_dist_*-cpushm_<rank>`), its shared-memory broadcast queues (`psm_*`, Python's `multiprocessing.shared_memory`) and its
multiprocessing semaphores (`sem.mp-*`; runner_fsm's own launcher makes none since Part 28).
Mutation seen to fail it: the engine-stop registry and the exchange's set-up as on main (a
`runner-fsm-engine-*` directory under TMPDIR; a `runner-fsm-*` file in /dev/shm).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_harness as h
from test_nothing_outside import TESTS, killed_at_each

# the job's processes, not the runner: once, on V1; slow (five vLLM jobs, 4.5 to 6.5 min on 2 loaded cores):
# make test-vllm-slow, beside the embedded case that runs in make test (test_nothing_outside.py)
pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent, pytest.mark.slow]

MOMENTS = ("workers-started", "segment", "mid-run", "shutdown", "after-stop")
VLLM_LEAVES = {"tmpdir": ("vllm_dist_", "torchinductor_"), "shm": ("psm_", "sem.mp-", "vllm_dist_")}  # vLLM's own names: see above

CHILD = """
    import itertools, json, sys
    import vllm_harness as h
    from vllm import SamplingParams

    if __name__ == "__main__":
        with h.open_llm(**json.loads(sys.argv[1])) as llm:
            rounds = int(sys.argv[2])
            for _ in range(rounds) if rounds else itertools.count():  # 0: until killed
                llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 11, 19)],
                             SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
"""


@pytest.fixture(scope="module")
def vllm_killed(vllm_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-outside")
    script = root / "child.py"
    script.write_text(textwrap.dedent(CHILD))

    def job(run: Path, moment: str):  # every moment the same job
        kw = h.llm_kwargs(vllm_models["llama"], run_dir=str(run), tensor_parallel_size=2,
                          runner_fsm={"consensus": True, "collective_timeout_s": 60})
        # A short name: vLLM puts a 36-character socket name in it, and a Unix socket's path holds
        # at most 107 bytes (under pytest-xdist's `popen-gwN` folder "<moment>/rpc" passed that).
        rpc = root / f"rpc{MOMENTS.index(moment)}"
        rpc.mkdir()
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
               "VLLM_RPC_BASE_PATH": str(rpc),
               "PYTHONPATH": os.pathsep.join([str(TESTS / "segment_site"), str(TESTS), str(Path.cwd()),
                                              os.environ.get("PYTHONPATH", "")])}
        # Killed mid-run or stopped at step 3, the job must still be running when the driver looks:
        # forked (the tier's start method) the workers decode a step in about 3 ms here, and on CI's
        # loaded box a run of 65 steps ended before the driver, polling the logs, saw step 3
        # (`after-stop` not reached); here, beside two busy loops, a run 7 times longer ended first
        # too. Those two jobs generate until they are killed; the others run once.
        rounds = 0 if moment in ("mid-run", "after-stop") else 1
        return [sys.executable, str(script), json.dumps(kw), str(rounds)], 2, env
    return killed_at_each(MOMENTS, root, job, timeout_s=900, at_once=2)


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_vllm_job_killed_whole_leaves_nothing_outside_its_run_dir(vllm_killed, moment):
    out = vllm_killed[moment]
    vllms = {where: [n for n in names if n.startswith(VLLM_LEAVES[where])] for where, names in out["new"].items()}
    print(f"\n{moment}: steps {out['steps']}; vLLM's own entries left: {vllms}")
    assert out["reached"], out  # killed at the moment named, not at some other end
    ours = {where: [n for n in names if not n.startswith(VLLM_LEAVES[where])] for where, names in out["new"].items()}
    assert ours == {"tmpdir": [], "shm": []}, out
