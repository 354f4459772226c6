"""An embedded DP=2 run killed with SIGKILL, every process at once, is never SOUND, wherever the
kill lands: nothing asked it to stop (no `stop` record), so its logs end in a death.

Five moments, in order: during start-up; between steps, early; inside a step; between steps,
late; inside a collective. The first four are cut from a later copy of each log, every rank at
the same record of the same step: an append-only, memory-mapped log had exactly those bytes then,
which is what a SIGKILL at that instant leaves on disk (the page cache is all there is). Their
windows (tens of milliseconds from the last rank's log opened to step 0's agreement; a couple of
milliseconds between a step's `finish` and the next agreement; well under one between the
agreement and the forward) are too short to catch by polling, and a test that waited for luck
failed when the run ended first (start-up missed once in a fresh clone's make test, "inside a
step" once here). The fifth, where a replica spends most of a step (inside the forward's expert
exchange), is caught by freezing the run (SIGSTOP to its process group) until its logs show it,
and the whole group is killed for real. Each is replayed: every complete line parses, and the
verdicts are the cut's (`unfinished`, `hang`, `missing_replica`, a `gap` for a cut line), never
SOUND.

Mutation seen to fail it: `settle_stops` (rules/stops.py) treating a log that ends between
steps as explained without any `stop` record (the quiescent-stop rule of before: it read the
between-steps placements SOUND).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner_fsm.audit.expand import Expander
from runner_fsm.audit.mapped import CHUNK, data_end
from runner_fsm.process.proc import stat_fields
from runner_fsm.replay.judge import replay

pytestmark = pytest.mark.multiproc

RANKS = 2


def _records(data: bytes) -> tuple[list[dict], bool]:
    """The complete records of the last step in a log's bytes, in full (compact on disk:
    `audit.expand`, read from that step's first record: each poll costs a step, not the log),
    and whether its last line is complete (False: a line being written, cut)."""
    text = data.rstrip(b"\n\x00")
    head_end = text.find(b"\n")
    try:
        job = json.loads(text if head_end < 0 else text[:head_end])  # the job's record, in full
    except ValueError:
        return [], False
    start = max(text.rfind(b'\n{"s":'), head_end)
    lines = text[start + 1:].split(b"\n") if head_end >= 0 else []
    expand = Expander(job)
    expand.resume()
    records, whole = [job], True
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            whole = i + 1 < len(lines)  # a line cut mid-write: only the last one can be
            continue
        records.append(expand(record))
    return records, whole


def _last(run_dir: Path, rank: int) -> dict | None:
    """The last complete record of a rank's log (it ends in a blank tail: `audit.mapped`)."""
    path = run_dir / f"rank-{rank}.jsonl"
    if not path.exists():
        return None
    records, _ = _records(path.read_bytes()[: data_end(path)])
    return records[-1] if records else None


def _finished(record, at_least: int = 0) -> bool:
    return (record is not None and record["event"] == "transition" and record["trigger"] == "finish"
            and isinstance(record["step_id"], int) and record["step_id"] >= at_least)


def _captured(record) -> bool:
    """Start-up's last record: the replica ready, before step 0's agreement."""
    return record["event"] == "transition" and record["trigger"] == "captured"


def _agreed(record) -> bool:
    """A step's `buffers` record: logged once its agreement is done, before its forward."""
    return record["event"] == "buffers"


# name -> (step, which record): every rank's log cut right after that record of that step (`_cut_at`)
CUTS = {
    "start-up": (-1, _captured),
    "between steps, early": (2, _finished),
    "inside a step": (10, _agreed),
    "between steps, late": (20, _finished),
}
KILLED = "inside a collective"  # the real SIGKILL: see `_in_collective`
MOMENTS = [*CUTS, KILLED]


def _in_collective(lasts) -> bool:
    """A rank's last record is an exchange it entered and has not left (most of a step is one)."""
    return any(r["event"] == "collective" and r["stage"] == "enqueue" for r in lasts)


def _session(pid: int) -> list[int]:
    """Processes of the session `pid` leads (the launcher and its ranks)."""
    wanted = str(pid).encode()  # field 6 of /proc/<pid>/stat, the session id
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) and fields[3] == wanted]


def _state(pid: int) -> str:
    return (stat_fields(pid) or [b"X"])[0].decode()


def _stop(pids) -> None:
    """SIGSTOP each of `pids`, then wait until every one has stopped."""
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_state(pid) in "TtZX" for pid in pids):
        time.sleep(0.0005)


def _resume(pids) -> None:
    for pid in pids:
        _signal(pid, signal.SIGCONT)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # the run is over
        pass


def _links(pid: int) -> set[str]:
    """What `pid`'s open descriptors name. One closed between the listing and its readlink (a
    rank still opening sockets) is left out, not the whole process."""
    links = set()
    try:
        fds = list((Path("/proc") / str(pid) / "fd").iterdir())
    except OSError:
        return links
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:
            pass
    return links


def _rank_pids(session: int, out: Path, wait_s: float = 10.0) -> dict[int, int]:
    """{rank: pid}: each rank's process is the one holding its log open (looked for again until
    every rank is found or `wait_s` passes)."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while len(found) < RANKS and time.monotonic() < deadline:
        for pid in _session(session):
            links = _links(pid)
            for rank in range(RANKS):
                if str(out / f"rank-{rank}.jsonl") in links:
                    found[rank] = pid
        if len(found) < RANKS:
            time.sleep(0.01)
    return found


def _cut_after(data: bytes, step: int, which) -> bytes | None:
    """A rank's log as it stood right after it logged `step`'s first record that `which`
    accepts, from any later copy of it: the bytes up to that line, then the blank tail its
    writer had mapped by then (whole chunks: `audit.mapped`). An append-only file had exactly
    these bytes at that instant, so this is what a SIGKILL landing then leaves on disk. None
    before that line was written."""
    text = data[: len(data.rstrip(b"\n\x00"))]
    head_end = text.find(b"\n")
    if head_end < 0:
        return None
    expand = Expander(json.loads(text[:head_end]))
    offset = head_end + 1
    while offset < len(text):
        line_end = text.find(b"\n", offset)
        line_end = len(text) if line_end < 0 else line_end
        try:
            record = expand(json.loads(text[offset:line_end]))
        except ValueError:  # the line being written: nothing after it is whole
            return None
        offset = line_end + 1
        if record["step_id"] == step and which(record):
            # data[offset - 1] is the line's newline (or the fill's, the same byte)
            mapped = max(CHUNK, -(-offset // CHUNK) * CHUNK)
            return data[:offset] + b"\n" * (mapped - offset)
    return None


def _cut_at(out: Path, step: int, which, alive) -> dict[int, bytes] | None:
    """{rank: its log's bytes} as each rank's log stood right after it logged the record `which`
    accepts of `step`: what a SIGKILL of every process leaves when it lands while every rank is
    just there. A consistent cut for the records used here: a step's `finish` (no rank has begun
    the next step, whose agreement every rank must join) and its `buffers` (every rank past the
    step's agreement, none yet in its forward's exchange). Cut from a later copy of each log
    (`_cut_after`). None when the run ends first."""
    paths = [out / f"rank-{rank}.jsonl" for rank in range(RANKS)]
    while alive():
        cuts = {rank: _cut_after(paths[rank].read_bytes(), step, which) for rank in range(RANKS)}
        if all(cut is not None for cut in cuts.values()):
            return cuts
        time.sleep(0.02)
    return None


@pytest.fixture(scope="module")
def killed(tmp_path_factory, models):
    """Run directories {moment: copy of the logs}, the last one the killed run itself."""
    root = tmp_path_factory.mktemp("sigkill")
    out = root / "run"
    cmd = [sys.executable, "-m", "runner_fsm.cli", "run", "--model", models[0], "--dp", str(RANKS), "--pcp", "1",
           "--requests", "24", "--max-new-tokens", "96", "--out", str(out)]
    log = open(root / "run.log", "w")
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    seen: dict[str, Path] = {}
    deadline = time.monotonic() + 240
    alive = lambda: proc.poll() is None and time.monotonic() < deadline  # noqa: E731
    try:
        while not all(map(_last, [out] * RANKS, range(RANKS))) and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = _rank_pids(proc.pid, out)
        assert sorted(pids) == list(range(RANKS)), pids
        everyone = [proc.pid, *pids.values()]
        for name, (step, which) in CUTS.items():
            logs = _cut_at(out, step, which, alive)
            if logs is None:
                break
            copy = root / name.replace(" ", "_").replace(",", "")
            copy.mkdir()
            for rank, data in logs.items():
                (copy / f"rank-{rank}.jsonl").write_bytes(data)
            seen[name] = copy
        while len(seen) == len(CUTS) and alive():
            _stop(everyone)
            if all(lasts := [_last(out, rank) for rank in range(RANKS)]) and _in_collective(lasts):
                os.killpg(proc.pid, signal.SIGKILL)
                seen[KILLED] = out
                break
            _resume(everyone)
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    assert list(seen) == MOMENTS, (f"the run ended (exit status {proc.returncode}) before every moment was"
                                   f" caught: {list(seen)}\n{(root / 'run.log').read_text()[-2000:]}")
    return seen


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_sigkill_is_never_sound(killed, moment):
    run = killed[moment]
    for path in sorted(run.glob("rank-*.jsonl")):
        data = path.read_bytes()
        end = data_end(path)  # what was written; the rest of the last chunk is blank
        assert len(data) % CHUNK == 0 and len(data) > end, "the killed writer's file was cut"
        lines = data[:end].split(b"\n")
        for line in lines[:-2]:  # every line is a record but the last, which a kill may have cut
            assert isinstance(json.loads(line), dict)
    report = replay(run)  # must not raise: the cut is a finding, not a crash of the tool
    kinds = {v.kind for v in report.verdicts}
    assert not report.sound, f"{moment}: {report.format()}"
    assert kinds <= {"hang", "gap", "missing_replica", "unfinished"}, report.format()
    assert not any(note.startswith("stop requested") for note in report.summary.notes), report.format()
    if moment.startswith("between steps"):  # each rank finished its step: nothing but the death to see
        assert sorted(r for v in report.verdicts for r in v.ranks) == list(range(RANKS)), report.format()
        assert kinds == {"unfinished"}, report.format()
    cli = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "replay", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1, cli.stdout + cli.stderr
