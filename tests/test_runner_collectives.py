"""Collectives: a group with peers runs in its own worker thread, in issue order, watched;
a group without peers runs inline. Both write the same records."""

import threading
import time

import anyio
import pytest

from runner_fsm.agree.collectives import CollectiveRunner
from runner_fsm.errors import CollectiveTimeout

pytestmark = pytest.mark.asyncio


class Records:
    def __init__(self):
        self.seen = []

    def collective(self, step_id, group, op, phase, shapes, pg_seq, stage, **extra):
        self.seen.append((group, op, pg_seq, stage))


async def test_group_with_peers_runs_in_one_worker_thread_in_issue_order():
    log, ran = Records(), []
    runner = CollectiveRunner(log, 5.0)
    loop_thread = threading.get_ident()

    def call(i):
        ran.append((i, threading.get_ident()))
        return i * 10

    results = [await runner.run("dp", "all_reduce", call, i, step_id=i) for i in range(3)]
    runner.close()
    assert results == [0, 10, 20]
    assert [i for i, _ in ran] == [0, 1, 2]
    threads = {t for _, t in ran}
    assert len(threads) == 1 and loop_thread not in threads
    assert log.seen == [("dp", "all_reduce", i, stage) for i in range(3) for stage in ("enqueue", "done")]


async def test_inline_group_runs_in_the_calling_thread_with_the_same_records():
    log = Records()
    runner = CollectiveRunner(log, 5.0, inline_groups=("dp",))
    assert await runner.run("dp", "all_reduce", threading.get_ident, step_id=0) == threading.get_ident()
    assert log.seen == [("dp", "all_reduce", 0, "enqueue"), ("dp", "all_reduce", 0, "done")]


async def test_a_stuck_call_times_out_and_the_group_goes_on_with_a_fresh_thread():
    log, release = Records(), threading.Event()
    runner = CollectiveRunner(log, 0.2)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"all_reduce on group 'dp' \(pg_seq 0, phase 0\) at step 0"
                                                r" did not finish within 0.2 s"):
        await runner.run("dp", "all_reduce", release.wait, 30, step_id=0)
    assert time.monotonic() - start < 2
    assert log.seen == [("dp", "all_reduce", 0, "enqueue")]  # the hang stays on record
    # The stuck thread still holds the first call; the next one must not queue behind it.
    with anyio.fail_after(2):
        assert await runner.run("dp", "all_reduce", lambda: "next", step_id=1) == "next"
    release.set()
    runner.close()


async def test_errors_of_the_call_reach_the_caller():
    runner = CollectiveRunner(None, 5.0)

    def fail():
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        await runner.run("expert", "forward", fail, step_id=0)
    assert await runner.run("expert", "forward", lambda: 1, step_id=1) == 1
    runner.close()
