"""A vLLM scheduler that fails at its FAIL_AT-th `schedule()` call (vLLM's `scheduler_cls` option,
public API): an engine-core failure in the middle of a run, for tests/test_vllm_engine_failure.py."""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

FAIL_AT = 12


class FailingScheduler(Scheduler):
    calls = 0

    def schedule(self, *args, **kwargs):
        FailingScheduler.calls += 1
        if FailingScheduler.calls == FAIL_AT:
            raise RuntimeError(f"the scheduler failed at call {FAIL_AT}")
        return super().schedule(*args, **kwargs)
