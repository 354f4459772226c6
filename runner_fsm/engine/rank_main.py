"""A rank's process of `engine.launch.spawn`: join the job's groups, run `fn`, report through
the pipe, leave.

Apart from the launcher (`engine.launch`), which imports no torch: this side does.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist

from runner_fsm.engine.groups import ProcessGroups, init_process_groups
from runner_fsm.named import named

# How long a rank of a failed run keeps its groups (and rank 0 the store) after reporting.
_STORE_GRACE_S = 2.0


def child_main(rank, fn, layout, host, port, args, pg_timeout_s, env, results) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # children share a few cores; intra-op threads only contend
    ok = _run_and_report(rank, fn, layout, host, port, args, pg_timeout_s, results)
    results.close()  # the report is in the pipe (`send` returned) before the process goes
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: unloading torch costs ~0.4 s of CPU per child, for nothing.
    os._exit(0 if ok else 1)


def _run_and_report(rank, fn, layout, host, port, args, pg_timeout_s, results) -> bool:
    groups = None
    try:
        # A named entry is imported first: every rank has its code loaded before the rendezvous,
        # so that the ranks leave it together and none waits on a peer's imports in a collective.
        fn = _resolve(fn)
        groups = init_process_groups(layout, rank, port, timeout_s=pg_timeout_s, host=host)
        # Pickle here, so that an unpicklable result is reported as this rank's error.
        results.send((rank, True, pickle.dumps(fn(groups, *args))))
    except BaseException as error:  # report everything, KeyboardInterrupt included
        results.send((rank, False, (type(error).__qualname__, str(error), traceback.format_exc())))
        return False
    finally:
        if groups is not None:
            _leave(groups)
    return True


def _leave(groups: ProcessGroups) -> None:
    """Rank 0 hosts the store: nobody leaves while a peer may still need it. After a fault
    the groups may be broken; the parent then ends the stragglers after a grace period."""
    try:
        dist.barrier(group=groups.world)
    except BaseException:  # the result is already reported; leaving is best effort
        # A failed run: rank 0 hosts the store where every rank's position lies, and peers
        # still timing out read it to name the culprit. Keep it up a moment before leaving.
        time.sleep(_STORE_GRACE_S)
    finally:
        dist.destroy_process_group()


def _resolve(fn):
    """`fn` itself, or the function a "module:function" name names."""
    return named(fn) if isinstance(fn, str) else fn
