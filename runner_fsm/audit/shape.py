"""The job's shape, carried by the first record of every audit log (event `job`).

A replay that took the shape of a run from the files it finds cannot see a file that is
missing: three logs of a DP=2 x PCP=2 run look like a sound run of three ranks. So each
process begins its log with the shape of the whole job and its own place in it: the size of
every parallel dimension, the world size, its global rank and coordinates, the members of
each process group it is in, and the host it ran on. Replay requires a log from every rank
the shape names (`rules.job`), and names ranks by their coordinates.

Ranks are numbered as vLLM numbers them (`vllm/distributed/parallel_state.py`): the global
ranks reshaped to `[dp, pp, pcp, tp]`, tensor parallelism the fastest dimension. The embedded
engine has no TP or PP (both 1), so its ranks are `dp * pcp_size + pcp`, as before.

Schema 2 added `tp_size`, `pp_size`, `coords`, `host` and `pid` (and `dcp_size` where decode
context parallelism is on); a schema-1 log's `job` record lacks them and reads as TP = PP = 1.

Writers: `AuditLog(..., shape=job_shape_fields(...))` writes it as record 0. The embedded
engine does; any other worker (the vLLM worker) calls the same function with its own sizes,
coordinates and, where its groups differ from the layout's, its own memberships.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

JOB_EVENT = "job"
DIMENSIONS = ("dp", "pp", "pcp", "tp")  # vLLM's rank order, the last the fastest
# The job record's own fields: `extra` may not use them.
SHAPE_FIELDS = frozenset({"dp_size", "pp_size", "pcp_size", "tp_size", "dcp_size", "world_size", "global_rank",
                          "coords", "groups", "host", "hosts", "pid"})


class Coords(NamedTuple):
    """A rank's place in the job, one coordinate per dimension (`DIMENSIONS`)."""

    dp: int
    pp: int = 0
    pcp: int = 0
    tp: int = 0

    def text(self, sizes: "Coords | None" = None) -> str:
        """'dp 1, pcp 0, tp 1': every dimension, or those whose size (in `sizes`) is above 1
        (the replica, `dp`, always)."""
        return ", ".join(f"{name} {value}" for name, value, size in zip(self._fields, self, sizes or (2,) * 4)
                         if name == "dp" or size > 1)


def global_rank_of(coords: Coords, sizes: Coords) -> int:
    """The global rank vLLM gives `coords` in a job of `sizes` (TP fastest)."""
    rank = 0
    for value, size, name in zip(coords, sizes, DIMENSIONS):
        if not 0 <= value < size:
            raise ValueError(f"{name} coordinate {value} outside [0, {size})")
        rank = rank * size + value
    return rank


def coords_of(global_rank: int, sizes: Coords) -> Coords:
    """The coordinates of `global_rank` in a job of `sizes` (the inverse of `global_rank_of`)."""
    world = 1
    for size in sizes:
        world *= size
    if not 0 <= global_rank < world:
        raise ValueError(f"global rank {global_rank} outside [0, {world})")
    values = []
    for size in reversed(sizes):
        global_rank, value = divmod(global_rank, size)
        values.append(value)
    return Coords(*reversed(values))


def layout_groups(coords: Coords, sizes: Coords) -> dict[str, list[int]]:
    """The members of each dimension's group instance `coords` is in: the ranks that differ
    from it in that dimension alone (vLLM's `dp`, `pp`, `pcp` and `tp` groups)."""
    out = {}
    for axis, name in enumerate(DIMENSIONS):
        out[name] = [global_rank_of(coords._replace(**{name: value}), sizes) for value in range(sizes[axis])]
    return out


def job_shape_fields(dp_size: int, pcp_size: int, dp_rank: int, pcp_rank: int, *,
                     tp_size: int = 1, pp_size: int = 1, tp_rank: int = 0, pp_rank: int = 0,
                     dcp_size: int = 1, groups: Mapping[str, Sequence[int]] | None = None,
                     host: str | None = None, hosts: Mapping[str, Sequence[int]] | None = None,
                     **extra: Any) -> dict[str, Any]:
    """The fields of the `job` record of the rank at (`dp_rank`, `pp_rank`, `pcp_rank`, `tp_rank`).

    `groups`: audit group name -> global ranks of the group instance this rank is in; by
    default the layout's (`dp`: the same coordinates in every replica, `pcp`: this replica's
    PCP ranks, `expert`: every rank; `tp` and `pp` where those are above 1). `host`: by default
    this machine's name; `hosts`: every rank's, {host: [global ranks]}, where the writer
    gathered them (replay names the host of a rank whose log is missing). `extra`: anything else the writer wants the log to open with (e.g.
    what a worker supplies that its host lacks)."""
    sizes = Coords(int(dp_size), int(pp_size), int(pcp_size), int(tp_size))
    for name, size in zip(DIMENSIONS, sizes):
        if size < 1:
            raise ValueError(f"job record: {name}_size must be >= 1, got {size}")
    coords = Coords(int(dp_rank), int(pp_rank), int(pcp_rank), int(tp_rank))
    global_rank = global_rank_of(coords, sizes)
    world_size = sizes.dp * sizes.pp * sizes.pcp * sizes.tp
    if groups is None:
        layout = layout_groups(coords, sizes)
        groups = {"dp": layout["dp"], "pcp": layout["pcp"], "expert": list(range(world_size))}
        groups.update({name: layout[name] for name in ("tp", "pp") if getattr(sizes, name) > 1})
    reserved = extra.keys() & SHAPE_FIELDS
    if reserved:
        raise ValueError(f"job record: extra fields {sorted(reserved)} are the shape's own")
    fields = {"dp_size": sizes.dp, "pcp_size": sizes.pcp, "tp_size": sizes.tp, "pp_size": sizes.pp}
    if int(dcp_size) > 1:
        fields["dcp_size"] = int(dcp_size)
    fields.update(world_size=world_size, global_rank=global_rank, coords=coords._asdict(),
                  groups={str(name): [int(r) for r in ranks] for name, ranks in groups.items()},
                  host=host if host is not None else socket.gethostname(), pid=os.getpid())
    if hosts is not None:
        fields["hosts"] = {str(name): sorted(int(r) for r in ranks) for name, ranks in hosts.items()}
    return {**fields, **extra}


@dataclasses.dataclass(frozen=True)
class JobShape:
    """The job as one log's first record declares it; identical in every log of one run."""

    run_id: str
    dp_size: int
    pcp_size: int
    world_size: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "JobShape":
        """The shape in a `job` record (TP = PP = 1 where a schema-1 record names neither);
        ValueError when a field is missing or not a size."""
        try:
            shape = cls(str(record["run_id"]), record["dp_size"], record["pcp_size"], record["world_size"],
                        record.get("tp_size", 1), record.get("pp_size", 1))
        except KeyError as err:
            raise ValueError(f"the job record lacks {err}") from None
        for name in ("dp_size", "pcp_size", "world_size", "tp_size", "pp_size"):
            value = getattr(shape, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the job record's {name} is {value!r}, not a size")
        if shape.world_size != shape.dp_size * shape.pp_size * shape.pcp_size * shape.tp_size:
            raise ValueError(f"the job record's world_size {shape.world_size} is not the product of its sizes"
                             f" ({shape.sizes_text()})")
        return shape

    @property
    def sizes(self) -> Coords:
        return Coords(self.dp_size, self.pp_size, self.pcp_size, self.tp_size)

    def coords(self, global_rank: int) -> Coords:
        """The coordinates of a global rank (`coords.dp` is its replica)."""
        return coords_of(global_rank, self.sizes)

    def rank_text(self, global_rank: int) -> str:
        """'rank 5 (dp 1, pcp 0, tp 1)': the rank and its coordinates in the dimensions in use."""
        return f"rank {global_rank} ({self.coords(global_rank).text(self.sizes)})"

    def sizes_text(self) -> str:
        """'dp=2 x pcp=2' (TP and PP where above 1, in vLLM's order)."""
        return " x ".join(f"{name}={size}" for name, size in zip(DIMENSIONS, self.sizes)
                          if name in ("dp", "pcp") or size > 1)

    def text(self) -> str:
        return f"run {self.run_id!r}: {self.sizes_text()}, world size {self.world_size}"
