"""Merge the per-rank step streams by step id, holding one pending step per rank.

Each rank's log is ordered by step, so a k-way merge on the step id sees every rank's
summary of step S together while holding nothing older: memory is bounded by the number of
ranks, not by the length of the run.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from runner_fsm.audit.stepsummary import RankStep


class Whereabouts:
    """Where each rank's log is while steps are merged: what `hang` and `missing_replica` cite."""

    def __init__(self) -> None:
        self.last_step: dict[int, int] = {}  # rank -> last step merged so far
        self.exhausted: set[int] = set()  # ranks whose log has no further step

    def whereabouts(self, rank: int, step: int) -> str:
        """Why `rank` has no record at `step`, in words."""
        if rank not in self.last_step and rank in self.exhausted:
            return "its log holds no step at all"
        if rank in self.exhausted and self.last_step.get(rank, step) < step:
            return f"its log ends at step {self.last_step[rank]}"
        return "it skipped to a later step"


class StepMerger(Whereabouts):
    """Yields (step, {rank: RankStep}) in step order; knows where absent ranks are."""

    def __init__(self, streams: Mapping[int, Iterator[RankStep]], *,
                 ended_before: Mapping[int, int | None] = {}, cut: set[int] = frozenset()):
        """`ended_before`: ranks whose log ended before this range, with their last step (None
        when it holds no step at all);
        `cut`: filled by the streams with the ranks they stopped at the end of the range
        (those logs go on, so such a rank is not at its end)."""
        super().__init__()
        self._streams = dict(streams)
        self._cut = cut
        self.exhausted.update(ended_before)
        self.last_step.update((rank, step) for rank, step in ended_before.items() if step is not None)
        self._heap: list[tuple[int, int, RankStep]] = []
        for rank, stream in self._streams.items():
            self._advance(rank, stream)

    def _advance(self, rank: int, stream: Iterator[RankStep]) -> None:
        following = next(stream, None)
        if following is None:
            if rank not in self._cut:
                self.exhausted.add(rank)
        else:
            heapq.heappush(self._heap, (following.step, rank, following))

    def __iter__(self) -> Iterator[tuple[int, dict[int, RankStep]]]:
        heap = self._heap
        while heap:
            step = heap[0][0]
            present: dict[int, RankStep] = {}
            while heap and heap[0][0] == step:
                _, rank, summary = heapq.heappop(heap)
                present[rank] = summary
                self.last_step[rank] = step
                self._advance(rank, self._streams[rank])
            yield step, present
