"""Did a forward read fresh inputs? (`stale_buffer_replay`, eager and graph alike)

The rule is `audit.checks.stale_inputs`, the one the runner applies online: the inputs of a
forward (the step's last `buffers` snapshot) must have been written since the previous step's
snapshot (write counts moved) and must not hold the very bytes of the last real batch (content
digests, where logged). A graph replay must also read the storage (ptr, shape) it was captured
on (`moved_storage`). Forward points are graph replays, eager target forwards, and forwards the
runner refused (a `buffers` record with reason `refused`: the inputs it would have used).
"""

from __future__ import annotations

from runner_fsm.audit.checks import moved_storage, stale_inputs


def _tuples(snapshot: dict) -> dict:
    """A logged snapshot {name: {ptr, shape, version, digest}} as the rule's tuples."""
    return {name: (fp["ptr"], fp["shape"], fp["version"], fp.get("digest")) for name, fp in snapshot.items()}


class BufferTracker:
    """One rank's buffer snapshots as its log is read: captures, the current step's last
    snapshot, the previous step's, and the last real batch's."""

    def __init__(self) -> None:
        self._captured: dict = {}  # graph size -> snapshot logged at its capture
        self._capture_size = None
        self.forget_steps()

    def forget_steps(self) -> None:
        """Drop what earlier steps left (a scan resumed mid-file); captures are kept."""
        self._previous = None  # last snapshot of an earlier step
        self._current = None  # last snapshot of the current step
        self._last_real = None  # last snapshot written for a real batch of an earlier step
        self._step_real = None  # the current step's real batch snapshot
        self._last_replay = self._last_replay_step = None

    def new_step(self) -> None:
        if self._step_real is not None:
            self._last_real, self._step_real = self._step_real, None
        if self._current is not None:
            self._previous, self._current = self._current, None

    def buffers(self, record, step: int) -> list[str]:
        """Problems of a `buffers` record (only a refused forward's inputs are judged here)."""
        snapshot = _tuples(record["buffers"])
        reason = record["reason"]
        if reason == "capture":
            self._captured[self._capture_size] = snapshot
        self._current = snapshot
        problems = []
        if reason == "refused":
            problem = stale_inputs(snapshot, self._previous, self._last_real)
            if problem:
                problems.append(f"forward at step {step} on stale inputs: {problem}")
        elif reason == "real":
            self._step_real = snapshot
        return problems

    def eager_forward(self, step: int) -> list[str]:
        """Problems of an eager target forward: its inputs are the step's last snapshot."""
        now = self._current
        if now is None:
            if self._previous is None:  # this writer logs no buffers at all: nothing to judge
                return []
            return [f"eager forward at step {step} has no buffers record in its step: nothing shows"
                    " its inputs were written"]
        problem = stale_inputs(now, self._previous, self._last_real)
        return [f"eager forward at step {step} reads stale inputs: {problem}"] if problem else []

    def graph(self, record, step: int) -> list[str]:
        """Problems of a graph record (only replays have any)."""
        action = record["action"]
        if action == "capture":
            self._capture_size = record.get("num_tokens")
            return []
        if action != "replay":
            return []
        size = record.get("num_tokens")
        reference = self._last_replay if self._last_replay_step == step else self._previous
        captured = self._captured.get(size) or next(reversed(self._captured.values()), None)
        self._last_replay, self._last_replay_step = self._current, step
        return check_replay(step, size, self._current, reference, captured, self._last_real)


def check_replay(step: int, size, now, reference, captured, last_real=None) -> list[str]:
    """Problems of one replay at `step` of the graph of `size` tokens (empty when sound)."""
    what = f"graph replay of {size} tokens at step {step}"
    if now is None:
        return [f"{what} has no buffers record in its step: nothing shows its inputs were written"]
    problems = []
    if captured is None:
        problems.append(f"{what}: no graph capture was logged before it, so its storage cannot be checked")
    else:
        moved = moved_storage(captured, now)
        if moved:
            problems.append(f"{what} reads storage that differs from capture: " + ", ".join(
                f"{name} ptr {captured[name][0]:#x} shape {list(captured[name][1])} -> "
                f"ptr {now[name][0]:#x} shape {list(now[name][1])}" for name in moved))
    stale = stale_inputs(now, reference, last_real)
    if stale:
        problems.append(f"{what} reads stale inputs: {stale}")
    return problems
