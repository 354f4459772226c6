"""vLLM's `segments_by_rank` for `fast_pcp_layout` (`runners/pcp/layout.py`): each rank's list of
`RankSegment`s, made when first read (MRV2 reads only its own rank's) from five columns:
request, first and end global token, first and end row of the rank.

Making the objects is most of what `fast_pcp_layout` costs a step (rank 0 of the benchmark's
realistic step has 134 segments at P=2), so they are made without the frozen dataclass's
`__init__`, whose three `object.__setattr__` calls cost two to three times as much: their
fields go straight into each instance's `__dict__`, as `__init__` would put them.
`pcp_layout.schema_problems` pins `RankSegment`'s source, so that this holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Callable

FIELDS = ("global_batch_req_idx", "global_batch_slice", "rank_local_batch_slice")  # RankSegment's, in order

_segment_cls: type | None = None


def rank_segments(columns: list[list[int]]) -> list:
    """vLLM `RankSegment`s from five columns (request, first and end global token, first and end
    row of the rank), made without their `__init__` (see the module's docstring)."""
    global _segment_cls
    if _segment_cls is None:  # looked up once: an import statement costs about 1 us a call
        from vllm.v1.worker.gpu.pcp_manager import RankSegment

        _segment_cls = RankSegment
    req, start, end, local, local_end = columns
    made = list(map(object.__new__, repeat(_segment_cls, len(req))))
    req_field, global_field, local_field = FIELDS
    for segment, i, global_slice, local_slice in zip(made, req, map(slice, start, end), map(slice, local, local_end)):
        fields = segment.__dict__
        fields[req_field], fields[global_field], fields[local_field] = i, global_slice, local_slice
    return made


class SegmentsByRank(Sequence):
    """vLLM's `segments_by_rank`: each rank's list of `RankSegment` built when first read
    (MRV2 reads only its own rank's), from `columns(rank)` or the columns `known` already."""

    def __init__(self, num_ranks: int, columns: Callable[[int], list[list[int]]]):
        self._num_ranks, self._columns = num_ranks, columns
        self._built: dict[int, list] = {}
        self._known: dict[int, list[list[int]]] = {}

    def known(self, rank: int, columns: list[list[int]]) -> None:
        """Rank `rank`'s columns, worked out already."""
        self._known[rank] = columns

    def __len__(self) -> int:
        return self._num_ranks

    def __getitem__(self, rank):
        if type(rank) is not int or not 0 <= rank < self._num_ranks:  # the step's own rank skips this
            if isinstance(rank, slice):
                return [self[r] for r in range(self._num_ranks)[rank]]
            rank = range(self._num_ranks)[rank]
        if rank not in self._built:
            columns = self._known.pop(rank, None)
            self._built[rank] = rank_segments(self._columns(rank) if columns is None else columns)
        return self._built[rank]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            list(a) == list(b) for a, b in zip(self, other))

    __hash__ = None
