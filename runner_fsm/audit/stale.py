"""Did a logged graph replay read fresh inputs? (`stale_buffer_replay`)

A captured graph reads the persistent buffers by address, so a replay is sound only when
(1) every buffer still has the storage (ptr, shape) it had at capture, and (2) every buffer
was written since the reference snapshot: the last `buffers` record of an earlier step, or
the previous replay of the same step. A buffer whose `version` did not move holds what the
previous batch left there, which is exactly the idle-dummy bug of DESIGN section 1.
Snapshots are the raw `buffers` objects of the records: {name: {ptr, shape, version}}.
"""

from __future__ import annotations


class BufferTracker:
    """One rank's buffer snapshots as its log is read: captures, the current step's last
    snapshot, and the reference a replay is judged against."""

    def __init__(self) -> None:
        self._captured: dict = {}  # graph size -> snapshot logged at its capture
        self._capture_size = None
        self.forget_steps()

    def forget_steps(self) -> None:
        """Drop what earlier steps left (a scan resumed mid-file); captures are kept."""
        self._previous = None  # last snapshot of an earlier step
        self._current = None  # last snapshot of the current step
        self._last_replay = self._last_replay_step = None

    def new_step(self) -> None:
        if self._current is not None:
            self._previous, self._current = self._current, None

    def buffers(self, record) -> None:
        snapshot = record["buffers"]
        if record["reason"] == "capture":
            self._captured[self._capture_size] = snapshot
        self._current = snapshot

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
        return check_replay(step, size, self._current, reference, captured)


def check_replay(step: int, size, now, reference, captured) -> list[str]:
    """Problems of one replay at `step` of the graph of `size` tokens (empty when sound)."""
    what = f"graph replay of {size} tokens at step {step}"
    if now is None:
        return [f"{what} has no buffers record in its step: nothing shows its inputs were written"]
    moved, stale = [], []
    reference = reference or {}
    for name, fp in now.items():  # one pass: this runs on every replay of the run
        old = reference.get(name)
        if old is not None and old["version"] == fp["version"]:
            stale.append(name)
        at_capture = captured.get(name) if captured is not None else None
        if at_capture is not None and (at_capture["ptr"] != fp["ptr"] or at_capture["shape"] != fp["shape"]):
            moved.append(name)
    problems = []
    if captured is None:
        problems.append(f"{what}: no graph capture was logged before it, so its storage cannot be checked")
    if moved:
        problems.append(f"{what} reads storage that differs from capture: " + ", ".join(
            f"{name} ptr {captured[name]['ptr']:#x} shape {captured[name]['shape']} -> "
            f"ptr {now[name]['ptr']:#x} shape {now[name]['shape']}" for name in moved))
    if stale:
        problems.append(f"{what} reads buffers not written since the previous step's snapshot:"
                        f" {', '.join(stale)} (versions {[now[n]['version'] for n in stale]} unchanged)")
    return problems
