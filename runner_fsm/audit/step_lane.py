"""The hot fields of writing a transition, held in one object: `LaneState`.

A vLLM step writes two transitions (its start and its `finish`), each right after vLLM's own
work evicted the CPU caches. There, what a write costs is mostly the cache lines it touches, so
the fields a transition reads and changes live in one small object shared by the three owners
that would otherwise each hold a few of them:

- `seq`: the seq of the log's next record (`AuditLog`);
- `step`, `step_t`, `state`: the compact renderer's last step, the time of its first record
  and the last transition's `dst` (`CompactRenderer`);
- `room`: the mapped file's bytes mapped and not written yet (`MappedFile`);
- `open`: whether a step's transition may take the short path (the log compact, no segment
  switch due, open): `AuditLog.step_transition` reads it.
"""

from __future__ import annotations


class LaneState:
    """The fields above; each owner sets its own at its start."""

    __slots__ = ("seq", "step", "step_t", "state", "room", "open")

    def __init__(self) -> None:
        self.seq, self.step, self.step_t, self.state, self.room, self.open = 0, None, 0, None, 0, False
