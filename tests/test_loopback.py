"""Nothing a run opens listens beyond 127.0.0.1: the sockets of a live DP=2 x PCP=2 run, as
`ss -ltnp` lists them, all bound to the loopback address."""

import os
import re
import subprocess
import threading
import time

import pytest

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import synthetic_requests

pytestmark = pytest.mark.multiproc

# State, Recv-Q, Send-Q, local address:port, peer, and the owners when `ss` may show them.
_LINE = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(?P<local>\S+):(?P<port>\d+)\s+\S+(\s+users:(?P<users>.*))?$")


def _family_pids(root: int) -> set[int]:
    """`root` and every process descended from it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    family, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in family} - family
        family |= more
        grew = bool(more)
    return family


def _listening(pids: set[int]) -> set[tuple[str, int, int]]:
    """(local address, port, pid) of every TCP listening socket of `pids`."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        match = _LINE.match(line.strip())
        assert match, f"unexpected ss line: {line!r}"
        for pid in map(int, re.findall(r"pid=(\d+)", match["users"] or "")):
            if pid in pids:
                found.add((match["local"], int(match["port"]), pid))
    return found


def test_every_socket_of_a_live_run_listens_on_loopback_only(tmp_path):
    # The fake model and a hang on replica 1 at step 3 keep the run alive for a few seconds.
    cfg = EngineConfig(model_dir=None, model_factory="runner_fsm.testing.fakes:engine_model_and_drafter",
                       run_dir=str(tmp_path), layout=ParallelLayout(2, 2),
                       collective_timeout_s=2.0, injections=("hang@replica=1,step=3",))
    requests = synthetic_requests(4, vocab_size=100, max_new_tokens=6)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (run_engine(cfg, requests, timeout_s=120), done.set()))
    thread.start()
    seen: set[tuple[str, int, int]] = set()
    try:
        while not done.is_set() and thread.is_alive():
            seen |= _listening(_family_pids(os.getpid()))
            time.sleep(0.2)
    finally:
        thread.join(timeout=150)
    assert done.is_set()
    pids = {pid for _, _, pid in seen}
    assert len(pids - {os.getpid()}) == 4, f"expected the 4 ranks' sockets, saw {sorted(seen)}"
    assert len(seen) >= 5, sorted(seen)  # rank 0's store and each rank's gloo listener at least
    beyond = sorted(s for s in seen if s[0] != "127.0.0.1")
    assert beyond == [], f"listening beyond 127.0.0.1: {beyond}"
