"""One replica's step work, bound to the transitions of the state machine.

The order inside a step is fixed:
validate -> plan / dummy -> DP agreement -> buffers -> forward -> restore -> sample -> draft sync.

- `prefill` / `decode`: validation runs in the `ready` state (before anything changes);
  the rest runs in the step state.
- `idle_dummy`: agreement with 0 tokens; unless every replica is idle, a dummy batch of
  the agreed size, a PCP context built from the dummy alone (never from saved state), the
  buffers refreshed for the dummy (same storage), and the forward.
- `draft_sync`: on every replica, fresh agreements for the replicated draft: DRAFT_PREFILL
  and, when K > 1, DRAFT_DECODE. The target's PCP-local agreement is never reused (`draft_step`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np

from runner_fsm import dp
from runner_fsm.agree.collectives import CollectiveRunner
from runner_fsm.agree.consensus import consensus_row, disagreement
from runner_fsm.agree.shm_exchange import replica_exchange
from runner_fsm.audit.decisions import DecisionLog, StepDecisions, batch_identity, tokens_digest
from runner_fsm.batch import ScheduledBatch, validate_batch
from runner_fsm.config import GraphMode, RunnerConfig
from runner_fsm.errors import DesyncError, StaleContextError
from runner_fsm.events import RealStep
from runner_fsm.faults import NO_FAULTS, Injector
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.pcp.context import PCPAttentionContext, PCPContextState, dummy_digest, plan_digest
from runner_fsm.pcp.plan import PlanWorkspace, plan_batch
from runner_fsm.replica import evidence
from runner_fsm.replica.components import Agreement, Drafter, ForwardStep, Model
from runner_fsm.replica.draft_step import DraftStep
from runner_fsm.replica.graphs import Fingerprints, GraphRunner, backend_for, check_refreshed
from runner_fsm.replica.spec import tokens_per_request
from runner_fsm.replica.written_positions import WrittenPositions
from runner_fsm.rules.checks import dispatch_inputs, output_digest, own_agreement_problem
from runner_fsm.rules.context_rule import context_problem
from runner_fsm.states import Trigger
from runner_fsm.states.machine import Handler, ReplicaMachine

CRASH_EXIT_CODE = 17  # the exit status of an injected crash


def _fields(value) -> dict:
    """A frozen dataclass of plain fields as a dict for the log (`asdict` deep-copies)."""
    return dict(vars(value))


@dataclasses.dataclass(frozen=True, eq=False)
class StepOutput:
    """What a step produced on this rank; identical on the PCP ranks of a replica."""

    step_id: int
    trigger: Trigger
    agreed: dp.DPSyncState
    num_rows: int  # rows this rank executed (0 when every replica was idle)
    graph: bool
    sampled: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class Replica(DraftStep):
    """The step work of one (dp_rank, pcp_rank) process, driven by its `ReplicaMachine`."""

    def __init__(self, config: RunnerConfig, *, dp_rank: int, pcp_rank: int, model: Model,
                 agreement: Agreement, collectives: CollectiveRunner, audit=None,
                 drafter: Drafter | None = None, device: str = "cpu", injector: Injector = NO_FAULTS,
                 pcp_group=None):
        """`pcp_group`: the replica's PCP process group, over which its PCP ranks compare the
        digests of what they sampled every real step (None: no peers to compare with)."""
        self.config = config.validate()
        self.dp_rank, self.pcp_rank = dp_rank, pcp_rank
        self.model, self.agreement, self.drafter = model, agreement, drafter
        self.collectives, self.audit = collectives, audit
        self.injector = injector
        self.pcp_group = pcp_group if config.layout.pcp_size > 1 else None
        self.requests = WrittenPositions()  # per request, the positions written to the cache
        # Block ids must exist in the model's cache (unknown for fakes without one).
        cache = getattr(model, "cache", None)
        self.num_kv_blocks = getattr(cache, "num_blocks", None)
        self.buffers = PersistentBuffers(config, device)
        self.contexts = PCPContextState(config.layout.pcp_size, pcp_rank)
        # Each step's plan is written here; the context and the buffers copy what they keep.
        self.plan_workspace = PlanWorkspace()
        self.graphs = GraphRunner(self.buffers, self._graph_forward,
                                  backend=backend_for(self.buffers.device), audit=audit)
        self.step_id = -1
        self.output: StepOutput | None = None
        self.agreed_this_step = False  # an abort must still join the step's agreement
        self.num_agreements = 0
        self._batch: ScheduledBatch | None = None
        self._step_start_fingerprint = None
        self._last_real_inputs = None  # fingerprint (with digests) of the last real batch's buffers
        # this step's decisions (logged on its `finish`), and the graph size its forward replayed (0: eager)
        self.decided, self._graph_rows, self._decision_log, self._exchange = None, 0, DecisionLog(), None
        self.machine = ReplicaMachine(self._handlers(), on_record=self._record_transition,
                                      on_fault=self._record_fault)

    def fault_due(self, kind: str) -> bool:  # asked ~7 times a step: no injections (a run's usual case), no call
        return bool(self.injector.injections) and self.injector.due(kind, self.dp_rank, self.step_id, self.pcp_rank)

    @property
    def drafting(self) -> bool:
        return self.config.num_speculative_tokens > 0

    def _handlers(self) -> dict[Trigger, Handler]:
        return {
            Trigger.CAPTURE: Handler(after=self._capture),
            Trigger.PREFILL: Handler(before=self._begin_real, after=self._run_real),
            Trigger.DECODE: Handler(before=self._begin_real, after=self._run_real),
            Trigger.IDLE: Handler(before=self._begin_dummy, after=self._run_dummy),
            Trigger.DRAFT: Handler(after=self._run_draft),
            **({Trigger.FINISH: Handler(after=self._check_consensus)} if self.config.consensus else {}),
        }

    # -- audit ------------------------------------------------------------------------

    def _record_transition(self, trigger, src, dst, outcome) -> None:
        if self.audit is not None:
            # a step's decisions, on its `finish`: also when its online consensus check failed
            end = trigger is Trigger.FINISH and outcome in ("ok", "error") and self.decided is not None
            self.audit.transition(self.step_id, trigger.value, src.value, dst.value, outcome,
                                  self._decision_log.entry(self.decided) if end else None)

    def _record_fault(self, error: BaseException) -> None:
        if self.audit is not None:
            self.audit.fault(self.step_id, error, f"dp_rank {self.dp_rank}: {error}")

    # -- capture ----------------------------------------------------------------------

    def _capture(self, _event) -> None:
        if self.config.graph_mode is GraphMode.FULL_DECODE_ONLY:
            self.graphs.capture(self.config.capture_sizes, step_id=self.step_id)

    def _graph_forward(self, num_tokens: int):
        # In graph mode every replica runs the same padded count: the exchange is uniform.
        agreed = dp.DPSyncState(self.step_id, dp.TARGET, (num_tokens,) * self.config.layout.dp_size,
                                dp.GRAPH_FULL, 0, 1, False)
        step = ForwardStep(self.step_id, num_tokens, agreed, num_tokens, is_dummy=self.buffers.is_dummy)
        return self.model.forward(self.buffers, step)

    # -- steps ------------------------------------------------------------------------

    def _begin_step(self) -> None:
        self.step_id += 1
        self.output, self.agreed_this_step = None, False
        self.decided, self._graph_rows = None, 0
        self._step_start_fingerprint = self.buffers.fingerprint()
        if self.fault_due("crash"):
            os._exit(CRASH_EXIT_CODE)  # injected: the process dies without a word

    def _begin_real(self, event: RealStep) -> None:
        self._begin_step()  # the step id moves first, so an abort names the step peers are at
        where = f"replica {self.dp_rank}, step {self.step_id}"
        validate_batch(event.batch, self.config, num_kv_blocks=self.num_kv_blocks, where=where)
        self.requests.check(event.batch, where)
        self._batch = event.batch

    def _begin_dummy(self, _event) -> None:
        self._begin_step()
        self._batch = None

    async def _agree(self, local: dp.LocalDispatch, inputs: dict | None = None) -> dp.DPSyncState:
        """One DP agreement; `inputs` (the dispatch inputs of a real batch) go on its record so
        that replay can recompute the count this replica must have sent."""
        if self.fault_due("hang"):
            await self.collectives.stall(self.step_id)  # injected: never reaches the agreement
        self.agreed_this_step = True
        self.num_agreements += 1
        sync = self.agreement.sync
        if local.phase == dp.TARGET and self.fault_due("corrupt-agreement"):
            def sync(column, _sync=sync):  # injected: our copy altered after the all-reduce
                return evidence.corrupted(_sync(column), self.dp_rank)
        extra = {"sent": _fields(local)}
        if inputs is not None:
            extra["inputs"] = inputs
        agreed = await self.collectives.run(
            "dp", "all_reduce", sync, local, step_id=self.step_id,
            phase=local.phase, shapes=[dp.wire_shape(local.phase, self.config.layout.dp_size)],
            enqueue_extra=extra, done_extra=lambda agreed: {"agreed": _fields(agreed)})
        problem = own_agreement_problem(self.step_id, local.phase, local.num_tokens, agreed.step_id,
                                        agreed.phase, agreed.num_tokens_for(self.dp_rank), agreed.graph_mode)
        if problem is not None:
            raise DesyncError(f"replica {self.dp_rank}, step {self.step_id}, {dp.phase_name(local.phase)}:"
                              f" its copy of the DP agreement is wrong: {problem}")
        return agreed

    def _wants_graph(self, num_tokens: int, uniform: int) -> int:
        cfg = self.config
        fits = bool(cfg.capture_sizes) and num_tokens <= cfg.capture_sizes[-1]
        ok = cfg.graph_mode is GraphMode.FULL_DECODE_ONLY and uniform > 0 and fits
        return dp.GRAPH_FULL if ok else dp.GRAPH_EAGER

    async def _run_real(self, event: RealStep) -> None:
        batch, cfg = event.batch, self.config
        pcp = cfg.layout.pcp_size
        # The plan's widest rank is the dispatch count (`num_tokens_for_dispatch`); planned
        # once here, and again only when the agreement pads it (graph mode).
        plan = plan_batch(batch.num_scheduled, batch.is_prefilling, batch.num_computed, pcp,
                          chunking=cfg.chunking, workspace=self.plan_workspace)
        n = plan.num_tokens_padded
        uniform = batch.uniform_query_len()
        reported = batch.num_tokens if self.fault_due("wrong-dispatch-count") else n
        inputs = dispatch_inputs(batch.num_scheduled, batch.is_prefilling, pcp, cfg.chunking)
        agreed = await self._agree(dp.LocalDispatch(
            self.step_id, dp.TARGET, dp.STATUS_OK, reported, self._wants_graph(n, uniform), uniform,
            batch.num_reqs), inputs)
        padded = agreed.num_tokens_for(self.dp_rank)
        if padded != n:
            plan = plan_batch(batch.num_scheduled, batch.is_prefilling, batch.num_computed, pcp,
                              padded_num_tokens=padded, chunking=cfg.chunking, workspace=self.plan_workspace)
        ctx = self.contexts.for_real(plan, batch.block_tables, cfg.block_size, step_id=self.step_id)
        self.buffers.write_real(plan, self.pcp_rank, batch.token_ids, batch.block_tables,
                                ctx.gathered_slot_mapping)
        written = self._log_buffers("real")
        batch_id = evidence.identity(self.step_id, False, plan.num_tokens_padded, plan_digest(plan))
        local = await self._forward(ForwardStep(self.step_id, padded, agreed, n), written,
                                    evidence.context_identity(ctx), batch_id)
        self._last_real_inputs = written
        restored = self.model.restore(local, ctx)
        sampled = tokens_per_request(np.asarray(self.model.sample(restored)), batch)
        if self.fault_due("pcp-divergence") and self.pcp_rank == cfg.layout.pcp_size - 1:
            sampled = evidence.diverged(sampled)  # injected: one PCP rank samples another token
        await self._compare_outputs(sampled)
        self.requests.record(batch)
        self.output = StepOutput(self.step_id, event.trigger, agreed, padded, agreed.use_graph, sampled)
        self.decided = StepDecisions(True, batch_identity(batch.req_ids, batch.num_scheduled), n, padded,
                                     self._graph_rows, 0, tokens_digest(sampled))

    async def _run_dummy(self, event) -> None:
        graph = dp.GRAPH_FULL if self.graphs.sizes and not self.fault_due("demote-graph-mode") else dp.GRAPH_EAGER
        pending = getattr(event, "pending", 0)
        agreed = await self._agree(dp.LocalDispatch(self.step_id, dp.TARGET, dp.STATUS_OK, 0, graph, 0, pending))
        rows = 0
        if not agreed.all_idle:
            # Eager peers keep their own counts (ours is 0): a one-row dummy joins them.
            rows = max(1, agreed.num_tokens_for(self.dp_rank))
            ctx = self._dummy_context(rows)
            written = None
            if not self.fault_due("skip-buffer-refresh"):
                self.buffers.write_dummy(1, rows)
                written = self._log_buffers("dummy")
            if not self.fault_due("skip-dummy-forward"):
                step = ForwardStep(self.step_id, rows, agreed, 0, is_dummy=True)
                digest = dummy_digest(rows, self.config.layout.pcp_size, self.pcp_rank)
                batch_id = evidence.identity(self.step_id, True, rows, digest)
                local = await self._forward(step, written, evidence.context_identity(ctx), batch_id)
                self.model.restore(local, ctx)
        self.output = StepOutput(self.step_id, Trigger.IDLE, agreed, rows, agreed.use_graph)
        self.decided = StepDecisions(False, 0, 0, rows, self._graph_rows, 0)

    def _dummy_context(self, rows: int) -> PCPAttentionContext:
        """The dummy's own context, built from the dummy alone for this step."""
        if self.contexts.last_real is not None and self.fault_due("stale-pcp-context"):
            return self.contexts.last_real  # injected: the hand-off bug this runner prevents
        return self.contexts.for_dummy(rows, num_reqs=1, step_id=self.step_id)

    async def _forward(self, step: ForwardStep, written: Fingerprints | None, ctx_id: dict, batch_id: dict):
        """The target forward (graph replay or eager), watched and logged as the expert
        group's collective: every replica must run it whenever any replica has work.
        Its record names the PCP context it uses (`ctx`: what the context says it was built
        for) and the batch it runs (`batch`: taken from the step's plan or dummy); the checks
        run after that record, inside the forward, so a refused forward leaves the same
        evidence as one that ran, and replay judges it without the runner's word.
        A dummy must not run on the bytes of the last real batch (`last_real`)."""
        last_real = self._last_real_inputs if step.is_dummy else None
        # injected rank-graph-mode: this rank alone takes the other mode (eager can always run)
        use_graph = step.agreed.use_graph != self.fault_due("rank-graph-mode") and self.graphs.can_replay(step.num_rows)
        self._graph_rows = step.num_rows if use_graph else 0
        if use_graph:
            run = functools.partial(self.graphs.replay, step.num_rows, step_id=self.step_id,
                                    since=self._step_start_fingerprint, last_real=last_real)
        else:
            if written is None:  # nothing logged this step: the inputs it reads go on record
                written = self._log_buffers("forward")
            run = functools.partial(self._eager_forward, step, written, last_real)
        return await self.collectives.run(
            "expert", "forward", self._checked_forward, run, ctx_id, batch_id,
            step_id=self.step_id, phase=dp.TARGET, shapes=[(step.num_rows,)],
            # Its rows are its shapes', its dispatch count the agreement's (`sent`): not repeated.
            enqueue_extra={"graph": use_graph, "ctx": ctx_id, "batch": batch_id},
            done_extra=self._exchange_stats)

    def _checked_forward(self, run, ctx_id: dict, batch_id: dict):
        """`run()` on the context built for this step's batch only (the rule replay applies)."""
        problem = context_problem(self.step_id, batch_id, ctx_id)
        if problem is not None:
            raise StaleContextError(f"replica {self.dp_rank}, step {self.step_id}: {problem}")
        return run()

    def _eager_forward(self, step: ForwardStep, now: Fingerprints, last_real: Fingerprints | None):
        check_refreshed(self._step_start_fingerprint, now, step_id=self.step_id, last_real=last_real)
        return self.model.forward(self.buffers, step)

    def _exchange_stats(self, _output) -> dict:
        """The bytes the forward's expert exchanges moved, when the model reports them."""
        stats = getattr(self.model, "exchange_stats", None)
        return stats() if stats is not None else {}

    async def _compare_outputs(self, sampled: dict[str, list[int]]) -> None:
        """The PCP ranks of a replica must sample the same tokens: each logs the digest of its
        output and, with PCP peers, compares it with theirs (one all_gather of two integers)."""
        if self.pcp_group is None:
            return  # no PCP peers: nothing to compare with
        digest, count = output_digest(sampled)
        gathered = await self.collectives.run(
            "pcp", "all_gather", evidence.gather_output_digests, self.pcp_group, self.step_id, digest,
            step_id=self.step_id, phase=dp.TARGET, shapes=[(2,)],
            enqueue_extra={"output": {"digest": digest, "tokens": count}})  # each peer logs its own
        if len({d for _, d in gathered}) > 1 or any(s != self.step_id for s, _ in gathered):
            raise DesyncError(f"replica {self.dp_rank}, step {self.step_id}: its PCP ranks sampled"
                              f" different tokens (output digest per PCP rank {[d for _, d in gathered]})")

    async def _check_consensus(self, _event) -> None:
        """`consensus`: the replica's ranks compare this step's decisions after its `finish` (`shm_exchange`)."""
        if self.pcp_group is None or self.decided is None:
            return  # no peers in the replica, or a step that decided nothing (it faulted)
        row = consensus_row(self.step_id, self.decided)
        self._exchange = self._exchange or replica_exchange(self.pcp_group, len(row), self.config.collective_timeout_s)
        rows = await self.collectives.run("pcp", "all_gather", self._exchange, row,
                                          step_id=self.step_id, phase=dp.TARGET, shapes=[(len(row),)])
        problem = disagreement(rows, self.step_id, lambda pcp_rank: f"PCP rank {pcp_rank}")
        if problem is not None:
            raise DesyncError(f"replica {self.dp_rank}, step {self.step_id}: {problem}")

    def _log_buffers(self, reason: str, fingerprint: Fingerprints | None = None) -> Fingerprints:
        """Log the buffers' fingerprint; returned so the forward's check need not take it again."""
        fingerprint = fingerprint or self.buffers.fingerprint(content=True)
        if self.audit is not None:
            self.audit.buffers(self.step_id, reason, fingerprint)
        return fingerprint

    # -- abort ------------------------------------------------------------------------

    async def abort_peers(self, status: int) -> Any:
        """Join this step's agreement with `status` so peers stop with our reason."""
        if self.agreed_this_step:
            return None
        local = dp.LocalDispatch(self.step_id, dp.TARGET, status, 0, 0, 0, 0)
        try:
            return await self._agree(local)
        except Exception as exc:  # the ReplicaFault naming us is the expected outcome
            return exc
