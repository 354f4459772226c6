"""The job's shape, carried by the first record of every audit log (event `job`).

A replay that took the shape of a run from the files it finds cannot see a file that is
missing: three logs of a DP=2 x PCP=2 run look like a sound run of three ranks. So each
process begins its log with the shape of the whole job: DP and PCP sizes, world size, its
own global rank (its replica and PCP rank are in every record's header, as is the run id)
and the members of each process group it is in. Replay requires a log from every rank the
shape names (`audit.job`).

Writers: `AuditLog(..., shape=job_shape_fields(...))` writes it as record 0. The embedded
engine does; any other worker (the vLLM worker) calls the same function with its own
sizes and, where its groups differ from the DP x PCP layout's, its own memberships.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from runner_fsm.config import ParallelLayout

JOB_EVENT = "job"


def job_shape_fields(dp_size: int, pcp_size: int, dp_rank: int, pcp_rank: int, *,
                     groups: Mapping[str, Sequence[int]] | None = None, **extra: Any) -> dict[str, Any]:
    """The fields of the `job` record of the rank at (`dp_rank`, `pcp_rank`).

    `groups`: audit group name -> global ranks of the group instance this rank is in; by
    default the DP x PCP layout's (`dp`: this PCP rank in every replica, `pcp`: this
    replica's PCP ranks, `expert`: every rank). `extra`: anything else the writer wants the
    log to open with (e.g. what a worker supplies that its host lacks)."""
    layout = ParallelLayout(int(dp_size), int(pcp_size)).validate()
    global_rank = layout.global_rank(int(dp_rank), int(pcp_rank))
    if groups is None:
        groups = {"dp": layout.dp_group_ranks()[pcp_rank], "pcp": layout.pcp_group_ranks()[dp_rank],
                  "expert": layout.expert_group_ranks()}
    reserved = extra.keys() & {"dp_size", "pcp_size", "world_size", "global_rank", "groups"}
    if reserved:
        raise ValueError(f"job record: extra fields {sorted(reserved)} are the shape's own")
    return {"dp_size": layout.dp_size, "pcp_size": layout.pcp_size, "world_size": layout.world_size,
            "global_rank": global_rank,
            "groups": {str(name): [int(r) for r in ranks] for name, ranks in groups.items()}, **extra}


@dataclasses.dataclass(frozen=True)
class JobShape:
    """The job as one log's first record declares it; identical in every log of one run."""

    run_id: str
    dp_size: int
    pcp_size: int
    world_size: int

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "JobShape":
        """The shape in a `job` record; ValueError when a field is missing or not a size."""
        try:
            shape = cls(str(record["run_id"]), record["dp_size"], record["pcp_size"], record["world_size"])
        except KeyError as err:
            raise ValueError(f"the job record lacks {err}") from None
        for name in ("dp_size", "pcp_size", "world_size"):
            value = getattr(shape, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the job record's {name} is {value!r}, not a size")
        if shape.world_size != shape.dp_size * shape.pcp_size:
            raise ValueError(f"the job record's world_size {shape.world_size} is not dp_size x pcp_size"
                             f" = {shape.dp_size} x {shape.pcp_size}")
        return shape

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(replica, PCP rank) of a global rank: the PCP ranks of a replica are contiguous."""
        return divmod(global_rank, self.pcp_size)

    def text(self) -> str:
        return f"run {self.run_id!r}: dp={self.dp_size} x pcp={self.pcp_size}, world size {self.world_size}"
