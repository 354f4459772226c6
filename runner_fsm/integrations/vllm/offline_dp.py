"""Offline data parallelism through vLLM: one process per DP rank (vLLM's SPMD mode).

`LLM(data_parallel_size=2)` in one process is refused by vLLM ("not supported for single-process
usage"); its offline recipe starts one process per DP rank with `VLLM_DP_RANK`,
`VLLM_DP_RANK_LOCAL`, `VLLM_DP_SIZE`, `VLLM_DP_MASTER_IP`, `VLLM_DP_MASTER_PORT` (and
`VLLM_HOST_IP=127.0.0.1`, else vLLM's message queue binds the machine's interface address), each
serving its own prompts. vLLM keeps the engines stepping together while any rank has work and
calls `execute_dummy_batch` on a rank that has none.

`launch_dp` runs a list of jobs (one `LLM` after another, each on a fresh master port) in the
same processes, so that model loading and imports are paid once per process. The ranks are forks
of one process that imported vLLM once (`python -m runner_fsm.integrations.vllm.offline_dp
SPEC_JSON DP_SIZE`): importing vLLM costs 6-7 s of CPU here, which a process per rank paid again
for every rank. The fork comes before anything of vLLM runs (no engine, no process group, no
OpenMP pool: import only), each rank then sets its own `VLLM_DP_RANK` and output, and the forking
process stays in the caller's process group (Ctrl-C reaches every rank) to reap the ranks and
write when each ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from runner_fsm.named import named


class Req(NamedTuple):
    req_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int | None = None


def close_llm(llm: Any) -> None:
    """Shut the engine down (its workers close their audit logs) and leave no process group
    behind for the next `LLM` in this process. An in-process engine core's shutdown already tears
    its groups down (vLLM 0.32's `EngineCore.shutdown`), and each teardown costs a full garbage
    collection (0.4 s of CPU here, every object visible again after vLLM's `gc.unfreeze`): it is
    repeated only for what the shutdown left."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, model_parallel_is_initialized

    llm.llm_engine.engine_core.shutdown()
    if dist.is_initialized() or model_parallel_is_initialized():
        cleanup_dist_env_and_memory()


def sampling(req: Any):
    from vllm import SamplingParams

    seed = getattr(req, "seed", None)
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, ignore_eos=True)
    # Triton's interpreter (MRV2 on the CPU, tests only) cannot run vLLM's top-p/top-k kernel.
    top_p = 1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.95
    return SamplingParams(temperature=0.8, top_p=top_p, seed=seed, max_tokens=req.max_new_tokens, ignore_eos=True)


def generate(llm: Any, requests: Sequence[Any]) -> tuple[dict[str, list[int]], float]:
    """Outputs per request id, and the seconds `generate` took."""
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, [sampling(r) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {r.req_id: list(o.outputs[0].token_ids) for r, o in zip(requests, outs)}, elapsed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Job:
    """One `LLM(**llm)` serving `per_rank[r]` on rank r: lists of (req_id, prompt, max_new_tokens)
    or (req_id, prompt, max_new_tokens, seed) (`Req`: greedy without a seed).
    `run`: "module:function" of `function(llm, requests) -> (outputs, seconds, extra)` to serve
    them instead of `generate` (a benchmark's timed runs); `extra` (JSON) is kept."""

    llm: dict
    per_rank: list
    run: str | None = None


@dataclasses.dataclass
class DPRun:
    codes: list[int | None]  # None: killed at the timeout
    ended_s: list[float]  # seconds from launch until each process ended
    ended_at: list[float]  # time.monotonic() when each process was seen ended (CLOCK_MONOTONIC,
    # the clock of the audit log's t_ns)
    logs: list[str]
    outputs: list[list[dict | None]]  # [job][rank] -> {req_id: tokens}, None when not reached
    job_s: list[list[float | None]]  # [job][rank] -> seconds that job's generate took
    extra: list[list[dict | None]] = dataclasses.field(default_factory=list)  # [job][rank] -> a `run`'s extra


class _Trees:
    """The processes each rank started, seen while it ran: a worker stuck in a collective
    outlives its engine's death (vLLM's worker processes), and once its parent is gone no tree
    leads to it. psutil is vLLM's dependency."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.seen, self._next = procs, set(), 0.0

    def look(self) -> None:
        """At most once a second: a walk of /proc is not free."""
        import psutil

        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + 1.0
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen.update(psutil.Process(proc.pid).children(recursive=True))

    def kill(self) -> None:
        import psutil

        self._next = 0.0
        self.look()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for child in self.seen:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def launch_dp(jobs: Sequence[Job], *, dp_size: int, cwd: str | None = None, timeout_s: float = 600.0,
              env: dict | None = None, stop_when=None) -> DPRun:
    """Run `jobs` (see the module docstring); every process is killed at `timeout_s`, or as soon
    as `stop_when()` (polled ten times a second) says so: a test that waits for a hang to show."""
    work = Path(tempfile.mkdtemp(prefix="fsm-dp-"))
    spec = [{"llm": j.llm, "per_rank": [[list(r[:4]) for r in reqs] for reqs in j.per_rank],
             "port": free_port(), "run": j.run} for j in jobs]
    (work / "spec.json").write_text(json.dumps(spec))
    child_env = dict(os.environ, **(env or {}), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1")
    if dp_size > 1:  # each rank adds its VLLM_DP_RANK and VLLM_DP_RANK_LOCAL (`_become_rank`)
        child_env.update(VLLM_DP_SIZE=str(dp_size), VLLM_DP_MASTER_IP="127.0.0.1")
    start = time.monotonic()
    # In the caller's session and process group: Ctrl-C reaches every rank (each records its
    # stop). A session per rank (with the kernel's autogroup scheduling on, as here, a
    # scheduling group per rank too) made every DP step wait about 1 s on this 2-core machine:
    # median gap between steps 1.02 s against 23 ms (tests/test_vllm_capped.py). Which of
    # vLLM's waits paid it was not traced.
    with open(work / "ranks.log", "w") as log:
        forker = subprocess.Popen([sys.executable, "-m", __name__, str(work / "spec.json"), str(dp_size)],
                                  env=child_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    codes: list[int | None] = [None] * dp_size
    ended = [float("nan")] * dp_size
    ended_at = [float("nan")] * dp_size
    deadline = start + timeout_s
    trees = _Trees([forker])
    try:
        while any(c is None for c in codes) and time.monotonic() < deadline and not (stop_when and stop_when()):
            trees.look()
            gone = forker.poll() is not None  # before reading: what it wrote before leaving is read
            for rank in range(dp_size):
                if codes[rank] is None and (end := _ended(work, rank)) is not None:
                    codes[rank], ended_at[rank] = end
                    ended[rank] = ended_at[rank] - start
            if gone:
                break  # the forking process left (every rank reaped, or it never forked): no more news
            time.sleep(0.1)
    finally:
        trees.kill()
    outputs, job_s, extra = [], [], []
    for j in range(len(jobs)):
        files = [work / f"out-{j}-{rank}.json" for rank in range(dp_size)]
        got = [json.loads(f.read_text()) if f.exists() else None for f in files]
        outputs.append([g["outputs"] if g else None for g in got])
        job_s.append([g["seconds"] if g else None for g in got])
        extra.append([g.get("extra") if g else None for g in got])
    # What the forking process printed (vLLM's import, or why no rank started) heads every rank's log.
    shared = (work / "ranks.log").read_text()
    logs = [shared + _read(work / f"rank-{rank}.log") for rank in range(dp_size)]
    return DPRun(codes, ended, ended_at, logs, outputs, job_s, extra)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _ended(work: Path, rank: int) -> tuple[int, float] | None:
    """(exit code, time.monotonic() it was reaped) of a rank, once the forking process wrote it."""
    path = work / f"ended-{rank}.json"
    if not path.exists():
        return None
    end = json.loads(path.read_text())
    return end["code"], end["at"]


def _fork_ranks(spec_path: str, dp_size: int) -> int | None:
    """Import vLLM once, fork the ranks, reap them. Returns the rank in a rank (which then runs
    its jobs and leaves as any Python process does: atexit, its own exit code), None here."""
    from vllm import LLM, SamplingParams  # noqa: F401  (what each rank would import for itself)

    work = Path(spec_path).parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the ranks' to record; this one reaps
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(dp_size):
        pid = os.fork()
        if pid == 0:
            _become_rank(work, rank, dp_size)
            return rank
        ranks[pid] = rank
    while ranks:
        pid, status = os.waitpid(-1, 0)
        if pid in ranks:  # written whole, then renamed: the launcher never reads half of it
            tmp = work / f"ended-{ranks[pid]}.tmp"
            tmp.write_text(json.dumps({"code": os.waitstatus_to_exitcode(status), "at": time.monotonic()}))
            tmp.replace(work / f"ended-{ranks.pop(pid)}.json")
    return None


def _become_rank(work: Path, rank: int, dp_size: int) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if dp_size > 1:
        os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank))
    fd = os.open(work / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _child(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    for j, job in enumerate(spec):
        os.environ["VLLM_DP_MASTER_PORT"] = str(job["port"])
        requests = [Req(rid, tuple(prompt), *rest) for rid, prompt, *rest in job["per_rank"][rank]]
        llm = LLM(**job["llm"])
        extra = None
        if job.get("run"):
            outputs, seconds, extra = named(job["run"])(llm, requests)
        else:
            outputs, seconds = generate(llm, requests)
        close_llm(llm)
        out = {"outputs": outputs, "seconds": seconds, "extra": extra}
        (Path(spec_path).parent / f"out-{j}-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    if (me := _fork_ranks(sys.argv[1], int(sys.argv[2]))) is not None:
        _child(sys.argv[1], me)
