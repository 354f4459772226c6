"""Data parallelism and drafting through vLLM: what `FSMWorker` installs when `dp_size > 1`.

The worker calls three things (see worker.py): `DPSupport.for_worker(worker)` once vLLM's
groups exist, `attach(model_runner)` once the model is loaded, and `close()` at shutdown.
Step ids and kinds are read from the worker's `ReplicaRecorder`. Installed here:
- (the MoE exchange collectives vLLM's CPU communicator lacks, `cpu/collectives.py`, are
  installed by the worker before its log opens, so that the log's first record names them);
- the agreement rows in vLLM's own DP all-reduce, with phase tags (`agreement`; where the runner syncs: its adapter);
- the expert exchange of every target forward as a `collective` record (group "expert", op
  "forward"), so `runner-fsm replay` sees which replica did not join a forward;
- the watchdog for `collective_timeout_s` (`watchdog`) and the faults of `inject`;
- the check of scheduled drafts against the drafter's proposals (`drafts`), through
  `before_step(scheduler_output)` and `proposed(draft_token_ids)`.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from runner_fsm import dp
from runner_fsm.agree.heartbeat import Heartbeat
from runner_fsm.agree.order import last_phase
from runner_fsm.config import ParallelLayout
from runner_fsm.errors import BatchError
from runner_fsm.integrations.vllm.common import inject
from runner_fsm.integrations.vllm.common.inject import VLLMInjector
from runner_fsm.integrations.vllm.dp import agreement
from runner_fsm.integrations.vllm.dp.drafts import DraftLedger
from runner_fsm.integrations.vllm.dp.watchdog import Watchdog
from runner_fsm.integrations.vllm.runners import RunnerAdapter


class DPSupport:
    def __init__(self, recorder, *, dp_rank: int, dp_size: int, timeout_s: float, injection=None, flight=None,
                 last_phase: int | None = None):
        self.recorder, self.dp_rank, self.audit = recorder, dp_rank, recorder.audit
        self.flight = flight  # the worker's WorkerFlight: dumped when the watchdog fires
        self.injector = VLLMInjector(injection, dp_rank, on_fire=lambda: self.audit.injected(
            injection.step, str(injection)))
        store = dist.distributed_c10d._get_default_store()  # the job's store, as the embedded engine uses
        # `last_phase` (from the drafter's K, the same on every replica) lets the agreement and the
        # watchdog name a replica that runs a draft pass no step has (`agree.order`, rule 0).
        heartbeat = Heartbeat(store, ParallelLayout(dp_size=dp_size, pcp_size=1).validate(), dp_rank,
                              last_phase=last_phase)
        self.watchdog = Watchdog(heartbeat, timeout_s, dp_rank=dp_rank, on_fault=self._log_fault).start()
        self.tap = agreement.AgreementTap(dp_rank, dp_size, audit=self.audit, beat=self.watchdog.beat,
                                             rows_hook=self._rows_hook, position=self._position,
                                             enqueue_extra=self._agreement_extra)
        self.tap.last_phase = last_phase
        self.drafts = DraftLedger(dp_rank)
        self.adapter: RunnerAdapter | None = None
        self._undo = lambda: None
        self._hooks: list = []
        self._forward_seq = itertools.count()
        self._forward_open: tuple[int, int, int] | None = None  # (step, seq, phase)
        self._draft_step, self._draft_forwards = agreement.NO_STEP, 0

    @classmethod
    def for_worker(cls, worker) -> "DPSupport | None":
        """For a vLLM worker whose groups exist (`install_extensions`); None for one replica."""
        par = worker.parallel_config
        if int(par.data_parallel_size) <= 1:
            return None
        worker.runner_adapter.check_dp_hooks()
        opts = worker.fsm_options
        spec = worker.vllm_config.speculative_config
        return cls(worker.recorder, dp_rank=int(par.data_parallel_rank), dp_size=int(par.data_parallel_size),
                   timeout_s=opts.collective_timeout_s, injection=_dp_injection(opts.inject),
                   flight=worker.flight,
                   last_phase=last_phase(int(spec.num_speculative_tokens) if spec is not None else 0))

    def attach(self, adapter: RunnerAdapter) -> None:
        """Once vLLM's model runner (and drafter) are loaded: agreement, phase tags, forwards, faults."""
        self.adapter = adapter
        self._undo = adapter.install_dp(self.tap)
        model = adapter.model()
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward)]
        draft = adapter.draft_model()
        if draft is not None:  # a drafter without DP syncs: its forwards are the collectives to see
            self._hooks += [draft.register_forward_pre_hook(self._before_draft_forward, with_kwargs=True),
                            draft.register_forward_hook(self._after_forward)]
        if self.injector.injection is not None:
            adapter.install_faults(skip_dummy_forward=self._skip_dummy_forward,
                                   skip_draft_sync=lambda: self._dummy_fault("skip-draft-sync"),
                                   draft_steps_mismatch=lambda: self._dummy_fault("draft-steps-mismatch"),
                                   pcp_fault=self._pcp_fault,
                                   demote_graph_mode=lambda: self._dummy_fault("demote-graph-mode"))

    def _position(self) -> tuple[int, bool]:
        rec = self.recorder
        return (rec.step_id if rec.in_step else agreement.NO_STEP), rec.kind == "idle"

    def abort(self, error: BaseException) -> bool:
        """A step failed on this replica before its DP agreement: send the abort status in it."""
        if self.adapter is None:
            return False
        status = dp.STATUS_BATCH_ERROR if isinstance(error, BatchError) else dp.STATUS_FAULT
        try:
            device, group = self.adapter.dp_group()
            return self.tap.abort(status, group, device=device, vllm_rows=self.adapter.DP_ROWS)
        except Exception:  # noqa: BLE001 - the step's own error is the one to report
            return False

    def before_step(self, scheduler_output) -> None:
        """At a real step's start: its scheduled drafts against the drafter's proposals."""
        so = scheduler_output
        self.drafts.forget(so.finished_req_ids)
        if so.scheduled_spec_decode_tokens:
            before = self.drafts.checked
            self.drafts.check_scheduled(self.recorder.step_id, so.scheduled_spec_decode_tokens)
            self.recorder.note(drafts_checked=self.drafts.checked - before)

    def proposed(self, drafts) -> None:
        """What `take_draft_token_ids` hands vLLM (of the step that just ended)."""
        self.drafts.proposed(self.recorder.step_id - 1, drafts.req_ids, drafts.draft_token_ids)

    def began(self, step_id: int, kind: str) -> None:
        """This replica's step `step_id` began as a `kind` step (prefill, decode, idle)."""
        self.injector.saw(step_id, kind)

    def never_fired(self, last_step: int) -> str | None:
        return self.injector.never_fired(last_step)

    def close(self) -> None:
        self.watchdog.stop()
        for hook in self._hooks:
            hook.remove()
        self._undo()

    # -- the target forward: an expert exchange every replica must join

    def _before_forward(self, _module, args, kwargs):
        return self._forward_begins(args, kwargs, dp.TARGET)

    def _before_draft_forward(self, _module, args, kwargs):
        self.tap.follow()
        if self.tap.step_id != self._draft_step:
            self._draft_step, self._draft_forwards = self.tap.step_id, 0
        self._draft_forwards += 1  # the first of a step is the draft's prefill, the rest decode
        return self._forward_begins(args, kwargs, dp.DRAFT_PREFILL if self._draft_forwards == 1 else dp.DRAFT_DECODE)

    def _forward_begins(self, args, kwargs, phase: int):
        self.tap.follow()
        step = self.tap.step_id
        if step == agreement.NO_STEP:
            return None
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("positions")
        rows = int(ids.shape[0]) if ids is not None else (int(args[0].shape[0]) if args else 0)
        seq = next(self._forward_seq)
        self._forward_open = (step, seq, phase)
        self.watchdog.enter(step, phase, "expert forward" if phase == dp.TARGET else "draft expert forward")
        extra = self.adapter.take_forward_extra() if phase == dp.TARGET and self.adapter is not None else None
        if self.audit is not None:
            self.audit.collective(step, "expert", "forward", phase, [[rows]], seq, "enqueue", **(extra or {}))
        return None

    def _after_forward(self, _module, _args, _output):
        if self._forward_open is None:
            return None
        step, seq, phase = self._forward_open
        self._forward_open = None
        if self.audit is not None:
            self.audit.collective(step, "expert", "forward", phase, None, seq, "done")
        self.watchdog.leave(step, phase)
        return None

    # -- injected faults

    def _rows_hook(self, rows: agreement.AgreementRows) -> agreement.AgreementRows:
        if rows.phase == dp.TARGET and self.injector.due("desync", rows.step_id):
            return agreement.AgreementRows(rows.step_id + 1, rows.phase, rows.seq, rows.kind, rows.status)
        return rows

    def _agreement_extra(self, rows: agreement.AgreementRows) -> dict:
        if rows.phase != dp.TARGET or self.adapter is None:
            return {}
        return self.adapter.agreement_extra(self.recorder.step_id)

    def _pcp_fault(self, kind: str) -> bool:
        """Asked by the PCP manager's evidence where `kind` would act (this replica's step)."""
        rec = self.recorder
        return rec.in_step and (kind == "wrong-dispatch-count" or rec.kind == "idle") and \
            self.injector.due(kind, rec.step_id)

    def _skip_dummy_forward(self) -> bool:
        """Asked past the idle replica's TARGET agreement, before its dummy forward."""
        tap = self.tap
        return tap.kind == agreement.KIND_DUMMY and self.injector.due("skip-dummy-forward", tap.step_id)

    def _dummy_fault(self, kind: str) -> bool:
        """Asked where the idle replica's drafter would run its dummy pass (and its syncs), and
        in its target DP sync (demote-graph-mode)."""
        tap = self.tap
        tap.follow()
        return tap.kind == agreement.KIND_DUMMY and self.injector.due(kind, tap.step_id)

    def _log_fault(self, step, error: BaseException) -> None:
        """The watchdog's report (a collective timeout), from its thread, before the process exits."""
        if self.audit is not None and not self.audit.closed:
            self.audit.fault(step, error, str(error))
        if self.flight is not None:
            self.flight.dump("timeout")


def _dp_injection(text: str | None):
    """The injection the DP support acts on: not one of a rank's (`replica_check`'s) nor one of a
    graph replay's (`graph_faults`)."""
    injection = inject.parse(text) if text else None
    return None if injection is None or injection.kind in inject.RANK_KINDS | inject.GRAPH_KINDS else injection
