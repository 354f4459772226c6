"""Where a rank of a vLLM job sits, and the run it writes: coordinates, groups, run directory and id.

vLLM numbers the ranks of a job `dp, pp, pcp, tp`, tensor parallelism the fastest
(`vllm/distributed/parallel_state.py`): the worker's `rank` argument is its rank inside its
replica (`pp, pcp, tp`), and its global rank is `dp_rank * (pp * pcp * tp) + rank`. Every
dimension is recorded in the log's `job` record (`audit.shape`); once vLLM's groups exist,
`place_in_groups` reads their members from vLLM itself and checks that they are the groups this
numbering implies, so a vLLM whose layout moved is refused at start-up rather than logged wrong.

The run is agreed over vLLM's world group (the whole job: every rank of every replica, on every
node) once, at start-up (`agree_run`): rank 0 names the default run directory and run id, an
explicit run id must be the same on every rank, and every rank learns every rank's host.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from runner_fsm.audit.shape import DIMENSIONS, Coords, coords_of, layout_groups
from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.common.errors import UnsupportedFeatureError


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """One rank's place in its job, as vLLM numbers it; identical however often it is derived."""

    sizes: Coords  # (dp, pp, pcp, tp) sizes
    coords: Coords
    global_rank: int
    dcp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.sizes.dp * self.sizes.pp * self.sizes.pcp * self.sizes.tp


def rank_place(vllm_config: Any, rank_in_replica: int) -> RankPlace:
    """The place of the worker vLLM made with `rank` = `rank_in_replica` (before any group exists)."""
    par = vllm_config.parallel_config

    def size(name: str) -> int:
        return int(getattr(par, name, 1) or 1)
    sizes = Coords(size("data_parallel_size"), size("pipeline_parallel_size"),
                   size("prefill_context_parallel_size"), size("tensor_parallel_size"))
    per_replica = sizes.pp * sizes.pcp * sizes.tp
    if not 0 <= int(rank_in_replica) < per_replica:
        raise UnsupportedFeatureError(f"FSMWorker: rank {rank_in_replica} is outside its replica's"
                                      f" {per_replica} ranks (pp x pcp x tp = {sizes.pp} x {sizes.pcp} x {sizes.tp})")
    inner = coords_of(int(rank_in_replica), Coords(1, sizes.pp, sizes.pcp, sizes.tp))
    dp_rank = int(par.data_parallel_rank)
    return RankPlace(sizes, inner._replace(dp=dp_rank), dp_rank * per_replica + int(rank_in_replica),
                     size("decode_context_parallel_size"))


def place_in_groups(place: RankPlace) -> dict[str, list[int]]:
    """The members of each of vLLM's groups this rank is in, read from vLLM (`dp`, `pp`, `pcp`,
    `tp`, `dcp` where DCP is on, and `expert`: the DP group, where vLLM's naive DP MoE exchange
    runs); refused when vLLM's world rank or groups are not the ones `place` implies."""
    from vllm.distributed import parallel_state as ps

    world_rank = ps.get_world_group().rank
    if world_rank != place.global_rank:
        raise UnsupportedFeatureError(f"FSMWorker numbers this rank {place.global_rank} (coordinates"
                                      f" {place.coords.text()}), vLLM's world group numbers it {world_rank}")
    live = {"dp": ps.get_dp_group(), "pp": ps.get_pp_group(), "pcp": ps.get_pcp_group(), "tp": ps.get_tp_group()}
    groups = {name: [int(r) for r in group.ranks] for name, group in live.items()}
    expected = layout_groups(place.coords, place.sizes)
    moved = [f"{name} {groups[name]} (expected {expected[name]})" for name in DIMENSIONS if groups[name] != expected[name]]
    if moved:
        raise UnsupportedFeatureError("FSMWorker: vLLM's groups are not laid out dp, pp, pcp, tp (TP fastest) as"
                                      f" this vLLM version was checked to lay them out: {'; '.join(moved)}")
    if place.dcp_size > 1:
        groups["dcp"] = [int(r) for r in ps.get_dcp_group().ranks]
    groups["expert"] = groups["dp"]
    return groups


@dataclasses.dataclass(frozen=True)
class AgreedRun:
    """What every rank of the job agreed at start-up."""

    run_dir: str
    run_id: str
    hosts: dict[str, list[int]]  # {host: [global ranks]}


def default_run_name() -> str:
    return f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def agree_run(run_dir: str | None, run_id: str | None, *, root: str = "runs",
              gather: Callable[[tuple], list[tuple]] | None = None) -> AgreedRun:
    """One run for the whole job, agreed over vLLM's world group (once, before any step).

    `run_dir`: this rank's choice (a node may write into its own directory), else rank 0's
    fresh `runs/vllm-<time>-<pid>`. `run_id`: the user's, which must then be the same on every
    rank (ConfigError naming the ranks and hosts that differ), else rank 0's generated name
    (never a node's directory name, so the directories of one job replay as one run).
    `gather`: every rank's entry in global rank order (default: over vLLM's world group)."""
    host = socket.gethostname()
    mine = (run_id, default_run_name(), host)
    entries = (gather or _gather_over_world)(mine)
    given = {entry[0] for entry in entries}
    if len(given) > 1:
        by_id: dict[Any, list[str]] = {}
        for rank, (rid, _, on) in enumerate(entries):
            by_id.setdefault(rid, []).append(f"{rank}@{on}")
        raise ConfigError("FSMWorker: run_id must be the same on every rank of a job; got "
                          + "; ".join(f"{rid!r} on ranks {', '.join(ranks)}" for rid, ranks in by_id.items()))
    default = entries[0][1]
    hosts: dict[str, list[int]] = {}
    for rank, entry in enumerate(entries):
        hosts.setdefault(entry[2], []).append(rank)
    return AgreedRun(str(run_dir) if run_dir else str(Path(root) / default), run_id or default, hosts)


def _gather_over_world(mine: tuple) -> list[tuple]:
    """Every rank's `mine`, in global rank order, over vLLM's world group (CPU)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size == 1:
        return [mine]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, mine, group=world.cpu_group)
    return [tuple(entry) for entry in out]
