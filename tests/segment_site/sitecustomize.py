"""Test set-up only (never imported by the package): holds a process still the moment it maps a
shared-memory segment, so a test can SIGKILL a job then, between the segment's creation and the
end of its set-up (`runner_fsm.agree.shm_exchange`). Found as `sitecustomize` by every Python
process whose PYTHONPATH holds this folder; acts only where RUNNER_FSM_TEST_SEGMENT_MARK names a
file: through Python's audit event `mmap.__new__`, the first mapping of runner_fsm's segment (a
file /dev/shm/runner-fsm-*, or the memfd runner-fsm-*) in a process writes that file (with the
segment's path) and sleeps.
"""

import os
import sys

_MARK = os.environ.get("RUNNER_FSM_TEST_SEGMENT_MARK")


def _hold_at_a_segment(event, args):
    if event != "mmap.__new__" or not args or args[0] is None or args[0] < 0:
        return
    try:
        target = os.readlink(f"/proc/self/fd/{args[0]}")
    except OSError:
        return
    if target.startswith(("/dev/shm/runner-fsm-", "/memfd:runner-fsm-")):  # not vLLM's own segments
        with open(f"{_MARK}.{os.getpid()}", "w") as mark:
            mark.write(target)
        os.replace(f"{_MARK}.{os.getpid()}", _MARK)  # whole, for the test that waits on it
        import time

        time.sleep(600)


if _MARK:
    sys.addaudithook(_hold_at_a_segment)
