"""Test support, run as a script inside a private mount namespace whose /dev/shm is a fresh
tmpfs (`test_nothing_outside`): starts a job in a process group of its own with TMPDIR an empty
directory, waits for a named moment in its logs, SIGKILLs the whole group, and prints, as JSON,
what the moment was and every entry then in TMPDIR and /dev/shm that was not there before.

    python outside_driver.py SPEC_JSON   (SPEC: cmd, env, run_dir, ranks, moment, tmpdir, mark)

Moments, named by what the logs (or the segment hook, `segment_site`) show:
- start-up: every rank's log is open, no step has finished (no exchange exists yet; looked for
  with the job frozen);
- workers-started: a grandchild of the job's first process titled as vLLM titles its workers
  (`VLLM::Worker*`: the engine core, past the plugin's `register()`, has started them) and no
  rank's log exists yet (FSMWorker's exchange comes after it);
- segment: a rank is held inside the shared-memory exchange's set-up, its segment mapped;
- mid-run: a rank's log is at step 5 or later;
- shutdown: a rank logged its `shutdown` transition (embedded) or vLLM's shutdown call (`stop`);
- after-stop: SIGTERM to the whole group at step 3, then the first `stop` record logged (looked
  for with the job frozen: see `_frozen`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runner_fsm.process.proc import parent_of, stat_fields


def _records(run_dir: Path, ranks: int) -> list[list[dict]]:
    """Each rank's records as its log held them at one moment. Read from a copy of the file's
    bytes: a reader that follows a log its writer is still filling never catches up with a vLLM
    worker that logs a step every 3 ms (one such read here took 179 s, to step 64,183, while this
    driver polled nothing). The copy is read leniently: a line the writer was still copying is
    skipped."""
    from runner_fsm.audit.records import lenient_records

    out = []
    for rank in range(ranks):
        copy = run_dir.parent / f"{run_dir.name}.read-{rank}.jsonl"
        try:
            copy.write_bytes((run_dir / f"rank-{rank}.jsonl").read_bytes())
            out.append(list(lenient_records(copy)))
        except (OSError, ValueError):
            out.append([])
    return out


def _step(records: list[dict]) -> int:
    return max((r["step_id"] for r in records if isinstance(r.get("step_id"), int)), default=-1)


def _finished(records: list[dict]) -> bool:
    return any(r["event"] == "transition" and r.get("trigger") == "finish" and r["step_id"] >= 0 for r in records)


def _workers_started(pid: int) -> bool:
    for child in _grandchildren(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if cmdline.read().startswith(b"VLLM::Worker"):
                    return True
        except OSError:
            continue
    return False


def _grandchildren(pid: int) -> list[int]:
    parents = {p: parent_of(p) for p in _pids()}
    return [p for p, parent in parents.items() if parents.get(parent) == pid]


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _moment_reached(spec: dict, logs: list[list[dict]], pid: int) -> bool:
    moment = spec["moment"]
    if moment == "workers-started":
        return _workers_started(pid) and not any(logs)
    if moment == "start-up":
        return all(logs) and not any(_finished(r) for r in logs)
    if moment == "segment":
        return Path(spec["mark"]).exists()
    if moment == "mid-run":
        return any(_step(r) >= 5 for r in logs)
    if moment == "shutdown":
        return any(r["event"] == "transition" and r.get("trigger") == "shutdown"
                   or r["event"] == "stop" and r.get("source") == "shutdown" for rs in logs for r in rs)
    if moment == "after-stop":
        return any(r["event"] == "stop" for rs in logs for r in rs)
    raise ValueError(moment)


def _nicer() -> None:
    """The job a little nicer than this driver, so that on a loaded box the driver still sees each
    moment in time. The job is a session of its own, so with the kernel's autogroups (on here) it
    is also a scheduling group of its own, shared out against the driver's as a whole whatever
    its processes' nice: its group is made nicer too. With the process nice alone, polls of 25 ms
    of CPU took 5 to 32 s of wall here while a vLLM job and two busy loops ran."""
    os.nice(5)
    with contextlib.suppress(OSError):  # no autogroups (or no /proc): the process nice is what there is
        with open("/proc/self/autogroup", "w") as group:
            group.write("5")


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid` (the job and every descendant it did not move)."""
    wanted = str(pgid).encode()  # field 5 of /proc/<pid>/stat, the process group
    return [pid for pid in _pids() if (fields := stat_fields(pid)) and fields[2] == wanted]


def _state(pid: int) -> bytes:
    return (stat_fields(pid) or [b"X"])[0]


@contextlib.contextmanager
def _frozen(pgid: int):
    """The job's whole group stopped (SIGSTOP, then waited for) for as long as the block runs.
    After the stop request a job logs its `stop` record and exits within about 20 ms (measured
    here, embedded DP=2 x PCP=2): a driver that polled a running job read the record after the
    job had gone (make test here read after-stop unreached twice in three, steps [3, 3, 3, 3]).
    Read frozen, the job moves only in the short gaps between reads, and a read that finds the
    moment leaves the job frozen for the kill."""
    os.killpg(pgid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_state(pid) in b"TtZX" for pid in _group(pgid)):
        time.sleep(0.0005)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed in the block, and reaped
            os.killpg(pgid, signal.SIGCONT)


def _read_frozen(spec: dict, run_dir: Path, stopped: bool) -> bool:
    """Whether the moment is now looked for with the job frozen (`_frozen`): the two whose window
    is short. After-stop once this driver asked for the stop (a `stop` record before it is vLLM's
    own end of a run, which SIGTERMs its engine core too: not the moment). Start-up once every
    rank's log exists (until then a look is a `stat`): about 130 ms of the job's time from the last
    log made to the first step done, missed by a driver polling a running job on a loaded box (a
    fresh-clone make test once found the run at its end, steps [19, 19, 19, 19])."""
    if spec["moment"] == "after-stop":
        return stopped
    if spec["moment"] == "start-up":
        return all((run_dir / f"rank-{rank}.jsonl").exists() for rank in range(spec["ranks"]))
    return False


def _listing(tmpdir: str) -> dict:
    return {"tmpdir": sorted(os.listdir(tmpdir)), "shm": sorted(os.listdir("/dev/shm"))}


def main(spec: dict) -> dict:
    run_dir = Path(spec["run_dir"])
    before = _listing(spec["tmpdir"])
    env = {**os.environ, **spec["env"], "TMPDIR": spec["tmpdir"]}
    if spec["moment"] == "segment":
        env["RUNNER_FSM_TEST_SEGMENT_MARK"] = spec["mark"]
    proc = subprocess.Popen(spec["cmd"], env=env, start_new_session=True, cwd=spec.get("cwd"),
                            preexec_fn=_nicer,
                            stdout=open(run_dir.parent / f"{run_dir.name}.out", "w"), stderr=subprocess.STDOUT)
    deadline, stopped, reached, logs = time.monotonic() + spec.get("timeout_s", 240), False, False, []
    while time.monotonic() < deadline and proc.poll() is None:
        if _read_frozen(spec, run_dir, stopped):
            with _frozen(proc.pid):
                if _moment_reached(spec, _records(run_dir, spec["ranks"]), proc.pid):
                    os.killpg(proc.pid, signal.SIGKILL)  # while frozen: the moment itself
                    reached = True
                    break
            time.sleep(0.002)
            continue
        if spec["moment"] == "start-up":  # looked for frozen only, once every log exists
            time.sleep(0.002)
            continue
        logs = _records(run_dir, spec["ranks"]) if spec["moment"] != "segment" else []
        if spec["moment"] == "after-stop":
            if any(_step(r) >= 3 for r in logs):
                os.killpg(proc.pid, signal.SIGTERM)  # a stop request, as from a terminal
                stopped = True
        elif _moment_reached(spec, logs, proc.pid):
            reached = True
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(500):  # the ranks die with the group; their files are what they left
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    after = _listing(spec["tmpdir"])
    new = {key: sorted(set(after[key]) - set(before[key])) for key in after}
    steps = [_step(r) if r else None for r in _records(run_dir, spec["ranks"])]  # None: no log
    return {"moment": spec["moment"], "reached": reached, "steps": steps, "new": new, "before": before}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
