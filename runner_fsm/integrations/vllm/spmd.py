"""Offline data parallelism through vLLM: one `LLM` process per DP rank (vLLM's SPMD mode).

`LLM(data_parallel_size=2)` in one process is refused by vLLM ("not supported for single-process
usage"); its offline recipe starts one process per DP rank with `VLLM_DP_RANK`, `VLLM_DP_SIZE`,
`VLLM_DP_MASTER_IP` and `VLLM_DP_MASTER_PORT` set, each serving its own prompts. vLLM then
runs one engine core per rank, keeps them stepping together while any rank has work, and calls
`execute_dummy_batch` on a rank that has none: with FSMWorker, its `idle_dummy` transition.

`run_dp` does exactly that and returns each rank's greedy outputs;
`python -m runner_fsm.integrations.vllm.spmd SPEC_JSON RANK` is the child.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from runner_fsm.engine.requests import Request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_dp(per_rank: Sequence[Sequence[Request]], llm_kwargs: dict, *, cwd: str | None = None,
           timeout_s: float = 600.0, log_dir: str | None = None) -> list[dict[str, list[int]]]:
    """Serve `per_rank[r]` on DP rank r (one process each); outputs per rank, in rank order."""
    work = Path(tempfile.mkdtemp(prefix="fsm-dp-"))
    spec = {"llm": llm_kwargs, "requests": [[[r.req_id, list(r.prompt), r.max_new_tokens] for r in reqs]
                                            for reqs in per_rank]}
    (work / "spec.json").write_text(json.dumps(spec))
    port, size = free_port(), len(per_rank)
    procs = []
    for rank in range(size):
        env = dict(os.environ, VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                   VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = open(Path(log_dir or work) / f"dp-rank-{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", __name__, str(work / "spec.json"), str(rank)],
                                       env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    try:
        for proc, _log in procs:
            codes.append(proc.wait(timeout=timeout_s))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    if any(codes):
        tails = [(Path(log_dir or work) / f"dp-rank-{r}.log").read_text()[-3000:] for r in range(size)]
        raise RuntimeError(f"DP ranks exited with {codes}:\n" + "\n-----\n".join(tails))
    return [json.loads((work / f"outputs-{rank}.json").read_text()) for rank in range(size)]


def _child(spec_path: str, rank: int) -> None:
    from runner_fsm.integrations.vllm.harness import close_llm, generate

    spec = json.loads(Path(spec_path).read_text())
    requests = [Request(rid, tuple(prompt), n) for rid, prompt, n in spec["requests"][rank]]
    from vllm import LLM

    llm = LLM(**spec["llm"])
    outputs, _ = generate(llm, requests)
    close_llm(llm)
    (Path(spec_path).parent / f"outputs-{rank}.json").write_text(json.dumps(outputs))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
