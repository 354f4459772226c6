"""Run the embedded engine: one process per rank (DP x PCP) on gloo, or in-process for 1x1.

The launcher side imports no torch (about 1.4 s of CPU): the ranks load it, each in its own
process, and `runner-fsm run` starts them that much sooner. The rank's code (`engine.worker`) is
imported where a rank runs: in this process only for an in-process run or under torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from runner_fsm.audit.seek import last_step_of
from runner_fsm.audit.segments import flight_entries
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.launch import RankFailure, spawn
from runner_fsm.engine.preflight import prepare
from runner_fsm.engine.rank_result import RankResult
from runner_fsm.engine.rendezvous import under_torchrun
from runner_fsm.engine.requests import Request
from runner_fsm.faults import Injection
from runner_fsm.process import flight_recorder
from runner_fsm.process.stop_requests import record_request
from runner_fsm.replay.discover import RANK_FILE
from runner_fsm.replay.rundirs import ranked_segments

# A rank's entry, named rather than imported: each rank imports it (torch with it) before it joins
# the job's groups, and this launcher never does (`engine.launch.spawn`).
RUN_RANK = "runner_fsm.engine.worker:run_rank"


@dataclasses.dataclass(frozen=True)
class EngineResult:
    """Outputs of every request, merged over replicas, and each rank's report."""

    outputs: dict[str, list[int]]
    ranks: tuple[RankResult, ...]
    run_dir: str

    @property
    def errors(self) -> list[RankResult]:
        return [r for r in self.ranks if r.error is not None]

    @property
    def primary(self) -> bool:
        """The process that reports: the caller, or global rank 0 under torchrun."""
        return os.environ.get("RANK", "0") == "0" or not under_torchrun()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def not_fired(self) -> dict[str, str]:
        """Injections that never applied ({injection: why}): those every rank of their replica
        that reported says it never applied (a rank that died reports nothing)."""
        reasons: dict[str, list[str]] = {}
        reported: dict[int, int] = {}
        for rank in self.ranks:
            if rank.not_fired is None:  # a rank that died before reporting says nothing
                continue
            reported[rank.dp_rank] = reported.get(rank.dp_rank, 0) + 1
            for injection, why in rank.not_fired.items():
                reasons.setdefault(injection, []).append(why)
        return {injection: whys[0] for injection, whys in reasons.items()
                if len(whys) == reported[Injection.parse(injection).replica]}

    @property
    def elapsed_s(self) -> float:
        return max(r.elapsed_s for r in self.ranks)

    @property
    def num_steps(self) -> int:
        return max(r.num_steps for r in self.ranks)


def run_engine(cfg: EngineConfig, requests: list[Request], *, timeout_s: float = 600.0,
               in_process: bool | None = None, fresh_interpreters: bool = False) -> EngineResult:
    """Serve `requests` to completion; a 1x1 layout runs in this process unless told not to.
    `fresh_interpreters`: how ranks start (`engine.launch.spawn`)."""
    cfg = prepare(cfg, requests)  # a user error stops here, before any process or step
    os.makedirs(cfg.run_dir, exist_ok=True)
    if in_process is None:
        in_process = cfg.layout.world_size == 1
    if under_torchrun():
        ranks = _run_under_torchrun(cfg, requests)
    elif in_process:
        from runner_fsm.engine.worker import run_rank

        ranks = [run_rank(None, cfg, requests)]
    else:
        # on by default (see flight_recorder), its dump within the log cap
        with flight_recorder.enabled_for_children(flight_entries(cfg.max_log_bytes)):
            ranks = [_as_result(r, cfg) for r in spawn(
                RUN_RANK, cfg.layout, cfg, requests, timeout_s=timeout_s,
                pg_timeout_s=cfg.collective_timeout_s + 30, collect_failures=True, host=cfg.listen_address,
                failed=lambda rank: rank.error is not None, on_stop=lambda *request: _stop_asked(cfg, *request),
                fresh_interpreters=fresh_interpreters)]
    outputs: dict[str, list[int]] = {}
    for rank in ranks:
        if rank.pcp_rank == 0:
            outputs.update(rank.outputs)
    return EngineResult(outputs, tuple(ranks), cfg.run_dir)


def _stop_asked(cfg: EngineConfig, signal_name: str, alive: list[int], gone: list[int]) -> None:
    """The launcher's stop request in the run directory, with the ranks alive then (a rank stopped
    before its log holds anything is explained by it: `rules.stops`)."""
    with contextlib.suppress(OSError):
        record_request(cfg.run_dir, cfg.run_id, signal_name, "the embedded launcher (runner-fsm run)", alive, gone)


def _run_under_torchrun(cfg: EngineConfig, requests: list[Request]) -> list[RankResult]:
    """This process is one rank of a `torchrun` job: serve, then share every rank's report."""
    import torch.distributed as dist

    from runner_fsm.engine.groups import init_process_groups_from_env
    from runner_fsm.engine.worker import run_rank

    flight_recorder.enable(flight_entries(cfg.max_log_bytes))  # before the first process group: torch reads it
    groups = init_process_groups_from_env(cfg.layout, timeout_s=cfg.collective_timeout_s + 30)
    try:
        mine = run_rank(groups, cfg, requests)
        ranks: list = [None] * cfg.layout.world_size
        dist.all_gather_object(ranks, mine, group=groups.world)
        return ranks
    finally:
        dist.destroy_process_group()


def _as_result(result, cfg: EngineConfig) -> RankResult:
    """A rank that died or was killed reports through its failure."""
    if not isinstance(result, RankFailure):
        return result
    dp_rank, pcp_rank = cfg.layout.coords(result.rank)
    step = _last_logged_step(cfg.run_dir, result.rank)
    message = result.message + (f"; its audit log ends at step {step}" if step is not None else "")
    error = {"type": result.exc_type, "message": message, "step": step}
    return RankResult(result.rank, dp_rank, pcp_rank, {}, 0, 0, 0, 0, 0.0, {}, 0, 0, error)


def _last_logged_step(run_dir: str, rank: int) -> int | None:
    """The step of the last complete record a dead rank left (None without one): in its log's
    last segment (`audit.segments`), past a blank tail or a line cut by the death."""
    segments = ranked_segments([Path(run_dir)], RANK_FILE, "audit log").get(rank)
    if not segments:
        return None
    try:
        return last_step_of(segments[-1][1])
    except OSError:
        return None
