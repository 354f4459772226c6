"""A served DP=2 job under a small log cap, for many steps (make test-vllm-slow; vLLM's HTTP server).

vLLM's OpenAI server with FSMWorker and `--data-parallel-size 2` (tiny Mixtral) serves a stream
of long completions until a desync injected at step `STEPS` stops it, with `max_log_bytes` of
2 MiB per rank: the logs rotate a hundred times and more. Then:
- at every segment switch the rank's files took no more than the cap (the writer measures at
  each switch, and the newest segment's `job` record carries the fullest it saw; a poll of the
  directory every 20 ms sees the same from outside);
- replay names the injected fault's culprit replica and step from what was kept, with the
  `pinned_steps` before it held by both ranks, says which steps were rotated away, and finds
  nothing else.

`RUNNER_FSM_SOAK_STEPS` sets the step of the fault (default 20,000; the run is about that long).
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
from test_vllm_server import DP2_BIND, free_port, start_server, stop, wait_ready

from runner_fsm.audit import read_records
from runner_fsm.replay.judge import replay
from runner_fsm.testing.logs import files_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = int(os.environ.get("RUNNER_FSM_SOAK_STEPS", "20000"))
CAP = max(512 << 10, (2 << 20) * STEPS // 20000)  # 2 MiB at 20,000 steps: rotated however long the run
PINNED = 200
CLIENTS = 4
def serve_until_it_stops(port: int, model: str, deadline: float) -> int:
    """Long greedy completions from `CLIENTS` threads until the server stops answering."""
    import httpx  # in the vLLM venv only, as the server tests'

    done, served = threading.Event(), [0]

    def client(seed: int) -> None:
        with httpx.Client(timeout=600) as http:
            while not done.is_set() and time.monotonic() < deadline:
                prompt = [3 + (seed * 37 + i * 11) % 500 for i in range(8 + seed)]
                try:
                    reply = http.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 450, "temperature": 0.0, "ignore_eos": True})
                except httpx.HTTPError:
                    break
                if reply.status_code != 200:
                    break
                served[0] += 1
                seed += CLIENTS
        done.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return served[0]


def test_a_long_served_run_stays_under_its_cap_and_keeps_the_fault(vllm_models, tmp_path):
    model = vllm_models["mixtral"]
    run_dir, port, log_path = tmp_path / "run", free_port(), tmp_path / "server.log"
    options = {"max_log_bytes": CAP, "pinned_steps": PINNED, "inject": f"desync@replica=1,step={STEPS}"}
    peak, polling = {}, threading.Event()

    def poll() -> None:
        while not polling.wait(0.02):
            for rank, size in files_bytes(run_dir).items():
                peak[rank] = max(peak.get(rank, 0), size)

    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = start_server(model, str(run_dir), port, log, "--data-parallel-size", "2",
                            "--data-parallel-address", "127.0.0.1", options=options,
                            env=DP2_BIND)  # one core per DP rank: see test_vllm_server
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            wait_ready(proc, port, log_path)
            served_from = time.monotonic()
            served = serve_until_it_stops(port, model, deadline=time.monotonic() + 3600)
            serving_s = time.monotonic() - served_from
        finally:
            stop(proc)
            polling.set()
            poller.join()
    report = replay(run_dir)
    print(f"\nsoak: {served} completions, {STEPS} steps in {serving_s:.0f} s of serving"
          f" ({STEPS / serving_s:.1f} steps/s), {time.monotonic() - started:.0f} s in all; peak per rank"
          f" {peak} bytes (cap {CAP}); rotated {[(s.first, s.last, s.ranks) for s in report.summary.rotated]}")
    named = [(v.replica, v.step) for v in report.verdicts
             if v.kind in ("hang", "collective_mismatch", "missing_replica", "agreed_mismatch")]
    assert named and named[0] == (1, STEPS), report.format()
    # (the culprit logs the agreement under the step it reported, one ahead: a `gap` there is the fault's own)
    assert not [v for v in report.verdicts if v.kind in ("missing_rank", "missing_replica", "illegal_transition")
                or (v.kind == "gap" and v.step < STEPS)], report.format()
    assert report.summary.rotated and all(span.first == 0 for span in report.summary.rotated)
    for rank in range(2):
        names = [n for n in os.listdir(run_dir) if re.match(rf"^rank-{rank}(\.\d+)?\.jsonl$", n)]
        newest = max(names, key=lambda n: int(n.split(".")[1]) if n.count(".") == 2 else 0)
        job = next(read_records(run_dir / newest))
        assert job["segment"] >= STEPS // 1000 and 0 < job["disk_peak"] <= CAP, job
        steps = {r["step_id"] for name in names for r in read_records(run_dir / name)}
        assert set(range(STEPS - PINNED, STEPS + 1)) <= steps
    assert peak and max(peak.values()) <= CAP, peak
