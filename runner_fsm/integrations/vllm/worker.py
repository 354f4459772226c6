"""`FSMWorker`: the worker vLLM would have used, with the replica state machine around it.

vLLM keeps its loader, model, kernels, sampler, drafters, padding and graph decisions; each
of its calls to the worker becomes transitions of the replica (DESIGN section 10):

| vLLM call                         | around vLLM's own work                                    |
|-----------------------------------|-----------------------------------------------------------|
| `__init__`                        | version gate, schema check against the installed vLLM     |
| `init_device`                     | audit log + journal opened; `install_extensions()`        |
| `load_model`                      | runner schema check; forward pre-hook on `runner.model`   |
| `determine_available_memory`      | `capture` (warm-up and profiling run in `capturing`)      |
| `compile_or_warm_up_model`        | JIT warm-up steps (`warmup`), graph captures; `captured`   |
|                                   | (the replica is `ready`, steps count from 0)              |
| `execute_model` (tokens > 0)      | `prefill` if any request prefills, else `decode`          |
| `sample_tokens`                   | sampled tokens noted; `draft` if the drafter ran; `finish`|
| `execute_dummy_batch`             | `idle`, vLLM's dummy run [+ `draft`], `finish`            |
| `take_draft_token_ids`            | the proposals noted in the journal                        |
| `check_health` / `shutdown`       | raise while faulted / `stop` recorded, `shutdown`, logs closed |

SIGINT and SIGTERM are recorded (`stop`) the moment they reach the worker's process, by handlers
chained in front of vLLM's (`stop_signals`); the front records them too (`stop_origin`).

A failure at any point of start-up is a `fault` record, then vLLM sees the error. Graph
captures and replays on Model Runner V2 are recorded from its graph manager's own calls
(`RunnerAdapter.attach_graphs`): on a device a replay runs no Python, so no hook sees it.

A step with zero scheduled tokens runs no forward and joins no DP collective in vLLM; it is
no step here either. Before every target forward, real or dummy, the pre-hook fingerprints
vLLM's persistent inputs (`probe`). Any error inside a step is logged as a `fault` and moves
the replica to `faulted`, then propagates to vLLM unchanged.

`FSMWorker` itself is made on first import (`make_worker_class`): a subclass of this mixin and
of the platform's worker (`platform_worker`), so vLLM's own `worker_cls="auto"` choice is kept.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from runner_fsm.audit import AuditLog
from runner_fsm.audit.segments import flight_entries
from runner_fsm.integrations.vllm import startup, stop_origin
from runner_fsm.integrations.vllm.common import schema, versions
from runner_fsm.integrations.vllm.cpu import rope as cpu_rope
from runner_fsm.integrations.vllm.dp.support import DPSupport
from runner_fsm.integrations.vllm.engine_stops import WorkerStops
from runner_fsm.integrations.vllm.graph_faults import GraphFaults
from runner_fsm.integrations.vllm.flight import WorkerFlight, groups as flight_groups, start as start_flight_recorder
from runner_fsm.integrations.vllm.options import WorkerOptions
from runner_fsm.integrations.vllm.recording.forwards import forward_context, hook_forward
from runner_fsm.integrations.vllm.recording.journal import Journal, step_entry
from runner_fsm.integrations.vllm.recording.probe import InputProbe
from runner_fsm.integrations.vllm.recording.recorder import CAPTURE_STEP, ReplicaRecorder
from runner_fsm.integrations.vllm.recording.step_kinds import StepKinds
from runner_fsm.integrations.vllm.replica_check import ReplicaCheck
from runner_fsm.integrations.vllm.rundir import agree_run, rank_place
from runner_fsm.integrations.vllm.runners import RunnerAdapter, adapter_for


class FSMWorkerMixin:
    """Put before the platform worker in the bases; see the module docstring."""

    recorder: ReplicaRecorder | None = None
    dp_support: DPSupport | None = None
    replica_check: ReplicaCheck | None = None
    graph_faults: GraphFaults | None = None
    _fault_owners: tuple = ()  # those above that hold an injection acting in a step (`began`)
    runner_adapter: RunnerAdapter | None = None
    rope_verdict: cpu_rope.RopeSelfTest | None = None  # the CPU rotary op's self-test (CPU only)
    rope_installed: str | None = None  # what install_stride_safe_rope did (None: nothing)
    supplies_pp_buffers = False  # a later pipeline stage's intermediate tensors (see `lacks_pp_buffers`)
    flight: WorkerFlight = WorkerFlight()  # no run dir yet: dumps nothing
    stops: WorkerStops | None = None

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs: Any):
        self.vllm_gate = versions.gate(schema.installed_version())  # an unchecked release stops here
        schema.check_schema(type(self))
        super().__init__(vllm_config, local_rank, rank, distributed_init_method,
                         is_driver_worker=is_driver_worker, **kwargs)
        self.fsm_options = WorkerOptions.from_vllm(vllm_config)
        self.place = rank_place(vllm_config, rank)  # every dimension, as vLLM numbers ranks
        self.dp_rank, self.pcp_rank, self.global_rank = self.place.coords.dp, self.place.coords.pcp, \
            self.place.global_rank
        self.drafting = vllm_config.speculative_config is not None
        self.draft_steps = int(vllm_config.speculative_config.num_speculative_tokens) if self.drafting else 0
        self.probe = InputProbe()
        self.step_kinds = StepKinds()  # which steps prefill
        self._dummy = False
        self._lean_hook = False  # the recorder's forward hook, not `_before_forward` (load_model)

    # -- start-up, in vLLM's order ------------------------------------------------------

    def init_device(self) -> None:
        # before vLLM's init_distributed_environment (see flight.py); its dump within the log cap
        start_flight_recorder(flight_entries(self.fsm_options.max_log_bytes))
        super().init_device()
        # The platform worker built its model runner here (V1 or MRV2, vLLM's choice): its adapter
        # names every attribute of it that the worker, the probe and the DP support read.
        self.runner_adapter = adapter_for(self.model_runner)
        opts = self.fsm_options
        run = agree_run(opts.run_dir, opts.run_id)  # over the whole job, every node
        run_dir = self.run_dir = run.run_dir
        front = stop_origin.tell_front(run_dir, run.run_id, self.global_rank)  # where a stop starts: recorded there
        audit = AuditLog(run_dir, run.run_id, self.global_rank, self.dp_rank, self.pcp_rank,
                         shape=startup.job_record(self, run.hosts, front), max_log_bytes=opts.max_log_bytes,
                         pinned_steps=opts.pinned_steps, compress_segments=opts.compress_logs)
        self.flight = WorkerFlight(run_dir, self.global_rank, flight_groups(self.parallel_config, self.runner_adapter))
        journal = Journal(run_dir, self.global_rank)
        audit.add_companion(journal)  # its segments go with the log's, under one cap
        self.recorder = ReplicaRecorder(audit, journal, fingerprints=opts.audit == "full")
        rec = self.recorder
        # vLLM installed its handlers first (the worker process's, the engine core's): ours go in front
        self.stops = WorkerStops.into(rec)  # a stop request as it arrives; the engine core's failure
        self.stops.install()
        self.install_extensions()

    def install_extensions(self) -> None:
        """Where extra collectives and interceptions are installed (vLLM's groups exist now,
        the model does not yet). Nothing in a single replica."""
        self.dp_support = DPSupport.for_worker(self)  # DP: agreement rows, watchdog, faults
        self.replica_check = ReplicaCheck.for_worker(self)  # TP/PCP/PP peers: gate, rank faults, consensus
        self.graph_faults = GraphFaults.for_worker(self)  # an injected fault at a graph replay
        self._fault_owners = tuple(owner for owner in (self.dp_support, self.graph_faults) if owner is not None)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with self._faults_recorded():
            super().load_model(*args, **kwargs)
            adapter = self.runner_adapter
            if self.rope_verdict is not None and self.rope_verdict.defective:
                self.rope_installed = cpu_rope.install_stride_safe_rope(adapter.model(), self.rope_verdict)
            schema.check_runner(adapter)
            rec = self.recorder
            hook = self.forward_hook()
            # The runner's input preparations are observed where something reads them: the probe
            # (staleness stamps), the PCP evidence, the DP support and the peers' check (MRV2's roles)
            inputs = not self._lean_hook or self.dp_support is not None or self.replica_check is not None
            adapter.attach(step_of=lambda: rec.step_id if rec.in_step else -1, inputs=inputs)
            hook_forward(adapter.model(), hook)
            if self.dp_support is not None:
                self.dp_support.attach(adapter)
            if self.replica_check is not None:
                self.replica_check.attach(adapter)  # and, after each step's end, its consensus check

    def determine_available_memory(self) -> int:
        self.recorder.start_capture()  # warm-up and profiling forwards run from here
        with self._faults_recorded():
            return super().determine_available_memory()

    def compile_or_warm_up_model(self):
        self.recorder.start_capture()
        with self._faults_recorded():
            schema.check_runner(self.runner_adapter, kv_cache=True)  # the KV cache exists now
            adapter = self.runner_adapter
            adapter.attach_kv()
            # The graph manager's own calls: each capture, and each replay (no module hook runs in one)
            adapter.attach_graphs(lambda desc: self._graph_forward(desc, True),
                                  lambda desc: self._graph_forward(desc, False))
            if self.graph_faults is not None:
                self.graph_faults.attach(adapter)
            self.check_lean_hook()
            if self.supplies_pp_buffers:
                adapter.supply_pp_buffers()
            times = super().compile_or_warm_up_model()  # JIT warm-up steps, graph captures
        self.recorder.end_capture()
        return times

    # -- steps ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any):
        so = scheduler_output
        if not so.total_num_scheduled_tokens:
            self.step_kinds.forget(so)
            return super().execute_model(so)
        rec = self.recorder
        if rec.step_id == CAPTURE_STEP:  # vLLM's JIT warm-up: whole steps before capture, not steps of the run
            return self._warm_up_step(so)
        kind = self.step_kinds.of(so)
        rec.begin_step(kind, None, so.num_scheduled_tokens, entry=step_entry(so, rec.step_id, kind))
        dp_support = self.dp_support
        for faults in self._fault_owners:  # the injections' owners: what this step is, for "never fired"
            faults.began(rec.step_id, kind)
        try:
            if dp_support is not None:
                dp_support.before_step(so)  # scheduled drafts vs. proposals
            out = super().execute_model(so)
            if out is not None:  # no sample_tokens follows (e.g. pipeline stages, pooling)
                rec.end_step()
            return out
        except BaseException as error:
            if dp_support is not None:  # first, while the step is open: peers waiting in
                dp_support.abort(error)  # its DP agreement stop too, naming this replica
            self._fault(error)
            raise

    def _warm_up_step(self, so: Any):
        """A whole step vLLM runs through the worker while it warms up (MRV2's `warmup_kernels`,
        FlashInfer's and vLLM-Ascend's warm-ups): recorded under `capturing` as a `graph` record
        of action `warmup`; its forwards are not evidence (the pre-hook skips them outside a
        step); a failure is a `fault` there."""
        rec = self.recorder
        rec.start_capture()
        rec.audit.graph(CAPTURE_STEP, "warmup", num_tokens=int(so.total_num_scheduled_tokens))
        with self._faults_recorded():
            return super().execute_model(so)

    def sample_tokens(self, grammar_output: Any):
        rec = self.recorder
        if rec.kind is None:  # not in a step (`rec.in_step`, without the property's call)
            return super().sample_tokens(grammar_output)
        try:
            out = super().sample_tokens(grammar_output)
            sampled = getattr(out, "sampled_token_ids", None)
            if type(sampled) is not list:
                sampled = None
                if (output := getattr(out, "model_runner_output", None)) is not None:
                    # An async output (MRV2): its tokens are copied and listed by vLLM's engine
                    # (`get_output()`) after this call, before the next step: read them then.
                    rec.note_later("sampled", output, "sampled_token_ids")
            rec.end_step(self.drafting, self.draft_steps, sampled)
            return out
        except BaseException as error:
            self._fault(error)
            raise

    def execute_dummy_batch(self) -> None:
        rec = self.recorder
        rec.begin_step("idle")
        for faults in self._fault_owners:
            faults.began(rec.step_id, "idle")
        self._dummy = True
        try:
            super().execute_dummy_batch()
            rec.end_step(self.drafting, self.draft_steps)  # vLLM's _dummy_run also ran the drafter's dummy_run
        except BaseException as error:
            self._fault(error)
            raise
        finally:
            self._dummy = False

    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        if drafts is not None and self.dp_support is not None:
            self.dp_support.proposed(drafts)
        if drafts is not None:
            self.recorder.note(drafts=drafts.draft_token_ids)
        return drafts

    def forward_hook(self):
        """The forward pre-hook `load_model` registers: the recorder's own where no forward is fingerprinted
        (`audit=transitions`) and no PCP evidence is read (a single PCP rank), else `_before_forward`."""
        self._lean_hook = not self.recorder.fingerprints and self.place.sizes.pcp == 1
        return self.recorder.forward_hook if self._lean_hook else self._before_forward

    def check_lean_hook(self) -> None:
        """Once the KV cache exists: PCP evidence built under the recorder's hook stops the worker."""
        if self._lean_hook and self.runner_adapter.pcp is not None:
            raise RuntimeError(f"FSMWorker: the {self.runner_adapter.name} runner built PCP evidence with"
                               " prefill_context_parallel_size 1; the recorder's forward hook reads none")

    def _before_forward(self, _module: Any, _args: tuple, args: dict) -> None:
        """The forward pre-hook (module, positional args, keyword args): the fingerprints of its inputs."""
        rec = self.recorder
        capturing = rec.kind is None  # not `rec.in_step`: a property is one more call per forward
        mode, desc, dp_counts = forward_context()
        if capturing and mode != "FULL":
            return  # warm-up and profiling forwards: only graph captures are evidence
        taken, copied, logged = None, (), False
        adapter = self.runner_adapter
        pcp = None if capturing or adapter.pcp is None else adapter.pcp_evidence()
        if rec.fingerprints:
            inputs = adapter.forward_inputs(args, dummy=self._dummy, capturing=capturing)
            taken, copied = self.probe.take(inputs, args)
        if pcp is not None:
            fingerprints, identities = pcp
            adapter.forward_extra = dict(identities, graph=mode == "FULL")
            if rec.fingerprints and mode != "FULL":
                # Under PCP the forward reads the PCP manager's buffers: their record goes on disk
                # now, before the forward's own record, where replay judges them (`stale_inputs`).
                rec.audit.buffers(rec.step_id, "dummy" if self._dummy else "real", fingerprints)
                logged = True
        rec.on_forward(taken, copied, self._dummy, mode, desc, dp_counts, logged)

    def _graph_forward(self, desc: Any, capturing: bool) -> None:
        """A FULL graph captured (after the manager's capture, once per descriptor) or about to be
        replayed (before the manager's replay), named by the graph manager's own call: its descriptor,
        and with fingerprints the inputs it reads, taken outside the graph (read back after the step)."""
        rec = self.recorder
        key = (desc.num_tokens, desc.num_reqs, desc.uniform_token_count is not None)  # as forward_context's
        if not capturing and self.graph_faults is not None:
            self.graph_faults.before_replay()  # skip-input-refresh: the step's inputs undone
        taken, copied = self.probe.take(self.runner_adapter.graph_inputs(desc, capturing), {}) \
            if rec.fingerprints else (None, ())
        rec.on_forward(taken, copied, self._dummy, "FULL", key, None)

    @contextlib.contextmanager
    def _faults_recorded(self) -> Iterator[None]:
        """Start-up and warm-up: a failure inside is a `fault` record, then raised to vLLM unchanged
        (the per-step paths inline the same: a context manager's frames would cost every step)."""
        try:
            yield
        except BaseException as error:
            self._fault(error)
            raise

    def _fault(self, error: BaseException) -> None:
        """An error inside a step: logged, the replica `faulted`, the Flight Recorder dumped."""
        self.recorder.fault(error)
        self.flight.dump("fault")

    # -- health and the end ---------------------------------------------------------------

    def check_health(self) -> None:
        rec = self.recorder
        if rec is not None and rec.fault_cause is not None:
            raise RuntimeError(f"FSMWorker replica {self.dp_rank} is faulted at step {rec.step_id}:"
                               f" {type(rec.fault_cause).__name__}: {rec.fault_cause}")
        super().check_health()

    def shutdown(self) -> None:
        rec = self.recorder
        if rec is not None and not rec.audit.closed:
            # First: vLLM may kill this process from here on (its executor kills workers still running)
            rec.audit.stop(rec.step_id, "shutdown", detail="vLLM shut the worker down")
        if self.stops is not None:
            self.stops.restore()
        if self.dp_support is not None:
            self.dp_support.close()
        unfired = next(filter(None, (owner.never_fired(rec.step_id - 1) for owner in (
            self.dp_support, self.replica_check, self.graph_faults) if owner is not None and rec is not None)), None)
        self.flight.dump("end")  # while vLLM's groups still exist
        try:
            if unfired is not None:  # the run tested nothing; replay says so from the logs too
                print(f"FSMWorker: {unfired}", file=sys.stderr, flush=True)
            if rec is not None:
                rec.shutdown()
        finally:
            super().shutdown()


def make_worker_class() -> type:
    """`FSMWorker` over the platform's worker (see `platform_worker`)."""
    from runner_fsm.integrations.vllm.platform_worker import platform_worker_cls

    base = platform_worker_cls()
    return type("FSMWorker", (FSMWorkerMixin, base), {"__module__": "runner_fsm.integrations.vllm",
                                                      "__qualname__": "FSMWorker",
                                                      "__doc__": FSMWorkerMixin.__doc__})
