"""What a replica knows of its requests, to refuse batches that contradict it.

The replica writes each request's K/V up to some position. A batch that claims computed
tokens for a request this replica never ran (an unknown id), or more computed tokens than
it ever wrote, would attend over cache slots that hold someone else's keys: it is refused
with a `BatchError` before anything changes.
"""

from __future__ import annotations

from runner_fsm.batch import ScheduledBatch
from runner_fsm.errors import BatchError


class WrittenPositions:
    """Per request id, how many leading positions this replica has written to its cache."""

    def __init__(self):
        self._written: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._written)

    def snapshot(self) -> dict[str, int]:
        return dict(self._written)

    def check(self, batch: ScheduledBatch, where: str) -> None:
        """Raise `BatchError` naming the request; changes nothing."""
        adopted = set(batch.cached_prefix_req_ids)
        for rid, computed in zip(batch.req_ids, batch.num_computed.tolist()):
            written = self._written.get(rid)
            if written is None and computed > 0 and rid not in adopted:
                raise BatchError(f"{where}: unknown request id {rid!r} claims {computed} computed tokens;"
                                 f" this replica never ran it")
            if written is not None and computed > written:
                raise BatchError(f"{where}: request {rid!r} claims {computed} computed tokens, but this"
                                 f" replica wrote only {written} positions of it")

    def record(self, batch: ScheduledBatch) -> None:
        """After a step: its positions are written; finished requests are forgotten."""
        ends = (batch.num_computed + batch.num_scheduled).tolist()
        for rid, end in zip(batch.req_ids, ends):
            self._written[rid] = end  # a recompute after preemption starts over
        for rid in batch.finished_req_ids:
            self._written.pop(rid, None)

