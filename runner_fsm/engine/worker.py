"""One rank of the embedded engine: its replica's scheduler driving the replica's runner.

Every step each replica either runs a batch or, with nothing to run, a dummy step, so all
replicas join every agreement. The run ends when an agreement shows every replica idle and
none with requests still to come.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import anyio
import torch.distributed as dist

try:
    BaseExceptionGroup
except NameError:  # Python 3.10: anyio depends on the backport
    from exceptiongroup import BaseExceptionGroup

from runner_fsm.agree.collectives import CollectiveRunner
from runner_fsm.agree.heartbeat import Heartbeat
from runner_fsm.audit import AuditLog
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.dp import GlooAgreement
from runner_fsm.engine.config import MISSING_MODEL, EngineConfig
from runner_fsm.engine.rank_result import RankResult
from runner_fsm.engine.rank_stops import StartupStops
from runner_fsm.engine.requests import Request, assign
from runner_fsm.engine.scheduler import Scheduler, SchedulerStalled
from runner_fsm.errors import ConfigError
from runner_fsm.events import Capture, DummyStep, Event, Fault, RealStep, Shutdown
from runner_fsm.faults import Injection, Injector, why_not_fired
from runner_fsm.named import named
from runner_fsm.pcp.buffers import BUFFER_NAMES
from runner_fsm.process import flight_recorder
from runner_fsm.process.stop_signals import stops_on_loop
from runner_fsm.replica.driver import Outcome, ReplicaRunner
from runner_fsm.replica.replica import Replica


def _model_and_drafter(cfg: EngineConfig, groups):
    if cfg.model_factory is not None:  # named by the caller: production imports no fakes itself
        return named(cfg.model_factory)(cfg, groups)
    if cfg.model_dir is None:
        raise ConfigError(MISSING_MODEL)
    from runner_fsm.model import load_drafter, load_model, model_groups

    mg = model_groups(groups, cfg.device)
    kw = dict(kv_num_blocks=cfg.num_kv_blocks, block_size=cfg.block_size, groups=mg,
              device=cfg.device, dtype=cfg.dtype)
    model = load_model(cfg.model_dir, **kw)
    drafter = None
    if cfg.num_speculative_tokens > 0:
        drafter = load_drafter(cfg.draft_dir, target_vocab_size=model.cfg.vocab_size, **kw)
    return model, drafter


def _agreement(groups, capture_sizes):
    if groups is None:
        from runner_fsm.dp import SingleReplicaAgreement

        return SingleReplicaAgreement(capture_sizes)
    return GlooAgreement(groups.dp, capture_sizes)


def _heartbeat(cfg: EngineConfig, groups) -> Heartbeat | None:
    if groups is None:
        return None
    store = dist.distributed_c10d._get_default_store()
    return Heartbeat(store, cfg.layout, groups.global_rank)


def build_runner(cfg: EngineConfig, groups, *, on_log: Callable[[AuditLog], None] | None = None) -> ReplicaRunner:
    """`on_log(audit)` is called as soon as the rank's log exists, before the model loads."""
    dp_rank, pcp_rank = (groups.dp_rank, groups.pcp_rank) if groups else (0, 0)
    global_rank = cfg.layout.global_rank(dp_rank, pcp_rank)
    rc = cfg.runner_config()
    layout = cfg.layout
    # `inject`: what the run is meant to test; replay names one that never acted (no `injected` record)
    audit = AuditLog(cfg.run_dir, cfg.run_id, global_rank, dp_rank, pcp_rank,
                     shape=job_shape_fields(layout.dp_size, layout.pcp_size, dp_rank, pcp_rank,
                                            buffer_names=list(BUFFER_NAMES),  # its buffers records, in order
                                            inject=[str(Injection.parse(i)) for i in cfg.injections]),
                     max_log_bytes=cfg.max_log_bytes, compress_segments=cfg.compress_logs)
    if on_log is not None:
        on_log(audit)
    model, drafter = _model_and_drafter(cfg, groups)
    replica = Replica(
        rc, dp_rank=dp_rank, pcp_rank=pcp_rank, model=model, drafter=drafter,
        agreement=_agreement(groups, rc.capture_sizes), audit=audit,
        collectives=CollectiveRunner(audit, rc.collective_timeout_s, heartbeat=_heartbeat(cfg, groups),
                                     inline_groups=cfg.layout.groups_without_peers()),
        device=cfg.device,
        injector=Injector((Injection.parse(i) for i in cfg.injections),
                          on_fire=lambda injection: audit.injected(injection.step, str(injection))),
        pcp_group=groups.pcp if groups else None,
    )
    return ReplicaRunner(replica)


async def _serve(runner: ReplicaRunner, sched: Scheduler, cfg: EngineConfig, counts: dict,
                 stops: StartupStops) -> None:
    """The scheduler feeds the replica's event stream; the runner's task consumes it.

    SIGINT and SIGTERM go on record the moment they arrive, then stop the rank as before: the
    handlers are chained here, inside the event loop, in front of asyncio's own SIGINT handler
    (which cancels the run cleanly), and taken out before the loop ends."""
    # Handlers only (early=False, in `stops_on_loop`), woken by the loop's wakeup fd. Each signal
    # is handed on from the loop: SIGTERM's default action, taken in the handler, killed a rank
    # mid-write before the `stop` record queued behind that write (CI: a rank of a stopped run
    # read as a death). A rank may hear the launcher's forwarded signal before the group's own
    # Ctrl-C (whichever of its threads the kernel hands each to): the launcher forwards the
    # signal it got (`launch.spawn`), so the request is named alike either way.
    async with stops_on_loop(stops.record, beneath=stops.kept_through_hand_over()):
        stops.loop_took_over()  # the start-up's watch goes: the loop's handlers record from here
        await _serve_events(runner, sched, cfg, counts)


async def _serve_events(runner: ReplicaRunner, sched: Scheduler, cfg: EngineConfig, counts: dict) -> None:
    send_events, events = anyio.create_memory_object_stream[Event](1)
    send_outcomes, outcomes = anyio.create_memory_object_stream[Outcome](1)

    async def submit(event: Event):
        await send_events.send(event)
        outcome = await outcomes.receive()
        if outcome.error is not None:
            raise outcome.error
        return outcome.output

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(runner.serve, events, send_outcomes)
        async with send_events, outcomes:
            await submit(Capture())
            await _step_loop(submit, runner, sched, cfg, counts)
            await submit(Shutdown("all requests finished"))


async def _step_loop(submit, runner: ReplicaRunner, sched: Scheduler, cfg: EngineConfig, counts: dict) -> None:
    step = 0
    while True:
        try:
            batch = sched.schedule(step)
        except SchedulerStalled as exc:  # logged as this replica's fault, so the log ends cleanly
            await submit(Fault(exc))
            raise
        out = await submit(RealStep(batch) if batch is not None else DummyStep(pending=sched.num_unfinished))
        counts["steps"] += 1
        state = out.trigger.value if batch is not None else "idle_dummy"
        if step in counts["watched"]:  # a step an injection names: what it was, if it never fires
            counts["watched"][step] = (state, bool(out.agreed.all_idle))
        counts["states"][state] = counts["states"].get(state, 0) + 1
        counts["handoffs"] += int(batch is None and counts["last_real"])
        counts["last_real"] = batch is not None
        if batch is not None:
            counts["real"] += 1
            counts["tokens"] += batch.num_tokens
            sched.update(out.sampled, out.drafts)
        if out.agreed.all_idle and out.agreed.num_reqs == 0:
            break
        step += 1
        _progress(cfg, runner, sched, step)
    _progress(cfg, runner, sched, step, final=True)


def _progress(cfg: EngineConfig, runner: ReplicaRunner, sched: Scheduler, step: int, *,
              final: bool = False) -> None:
    """A one-line progress bar on stderr, from global rank 0 (its replica's requests)."""
    replica = runner.replica
    if not cfg.progress_every or replica.dp_rank or replica.pcp_rank:
        return
    tty = sys.stderr.isatty()  # a bar redrawn in place; in a log, a line now and then
    every = cfg.progress_every if tty else 25 * cfg.progress_every
    if final or step % every == 0:
        done, total = len(sched.finished), len(sched.finished) + sched.num_unfinished
        bar = "#" * (20 * done // max(total, 1))
        start = "\r" if tty else ""
        print(f"{start}[runner-fsm] step {step:5d} replica 0 [{bar:<20s}] {done}/{total} requests",
              end="\n" if final or not tty else "", file=sys.stderr, flush=True)


def run_rank(groups, cfg: EngineConfig, requests: list[Request]) -> RankResult:
    """Entry of one rank (`groups` None for a single process): serve, then report. A rank of a
    launched job checks the Flight Recorder's dump call its launcher turned on without loading
    torch (`flight_recorder.enabled_for_children`): a missing one fails the rank before its
    first step, saying how to run without it."""
    if groups is not None and flight_recorder.active():
        flight_recorder.require_api()
    dp_rank, pcp_rank = (groups.dp_rank, groups.pcp_rank) if groups else (0, 0)
    counts = {"steps": 0, "real": 0, "tokens": 0, "states": {}, "handoffs": 0, "last_real": False}
    sched = Scheduler(assign(requests, cfg.layout.dp_size)[dp_rank], cfg.scheduler_config())
    start = time.perf_counter()
    error = None
    stops = StartupStops()  # a stop request on record from the log's first moment (`rank_stops`)
    try:
        stops.arm()  # before the log exists: what comes first is held for it
        runner = build_runner(cfg, groups, on_log=stops.log_opened)
        stops.steps_of(lambda: runner.replica.step_id)
        injector = runner.replica.injector
        counts["watched"] = {i.step: None for i in injector.injections if i.replica == dp_rank}
        # The first `anyio.run` of a process imports anyio's event-loop backend (about 50 ms): done
        # here, under the start-up handlers, not in the hand-over, where no handler of ours runs.
        anyio.run(_nothing)
    except BaseException:  # a stop during start-up goes on as before (KeyboardInterrupt), recorded
        stops.hand_over()
        raise
    try:
        stops.hand_over()  # to the loop's handlers (`_serve`); the watch hears what comes between
        anyio.run(_serve, runner, sched, cfg, counts, stops)
    except Exception as exc:  # reported as data: every rank's own typed error matters
        exc = _unwrap_group(exc)
        error = {"type": type(exc).__name__, "message": str(exc), "step": runner.replica.step_id}
    except BaseException as interrupt:  # a SIGINT's KeyboardInterrupt: recorded, if it came in the hand-over
        stops.missed(_unwrap_group(interrupt))
        raise
    finally:
        stops.loop_took_over()  # a loop that never got there: the watch goes now
        anyio.run(runner.close)
        if groups is not None:  # the Flight Recorder's buffer, beside the audit log
            flight_recorder.dump_beside(cfg.run_dir, cfg.layout.global_rank(dp_rank, pcp_rank),
                                        flight_recorder.groups_of(groups), flight_recorder.reason_of(error))
    last_step = counts["steps"] - 1 if counts["steps"] else None
    not_fired = {str(i): why_not_fired(i, counts["watched"].get(i.step), last_step)
                 for i in injector.not_fired(dp_rank)}
    return RankResult(cfg.layout.global_rank(dp_rank, pcp_rank), dp_rank, pcp_rank, sched.results(),
                      counts["steps"], counts["real"], sched.num_preemptions, counts["tokens"],
                      time.perf_counter() - start, counts["states"], counts["handoffs"],
                      runner.replica.num_agreements, error, not_fired)


async def _nothing() -> None:
    pass


def _unwrap_group(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups of the task group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
