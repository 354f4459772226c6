"""vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`; the CPU's `CPUModelRunner` in
`vllm/v1/worker/cpu/` subclasses it).

MRV2 has one `execute_model` for real and dummy steps. Its persistent inputs live in
`runner.input_buffers` (`InputBuffers`), the block tables and slot mappings in
`runner.block_tables`, and under PCP in the PCP manager's own buffers; each step's `InputBatch`
holds views of them. The views a forward reads are handed to `prepare_attn` (real) or
`prepare_dummy_attn` (dummy), right after the DP sync and before the forward: the adapter wraps
those two on the instance and keeps what they were given and returned, so the probe hashes
exactly the rows the forward reads, PCP-local rows included.

The DP sync is `sync_cudagraph_and_dp_padding` (`gpu/dp_utils.py`), whose inline
`dist.all_reduce` carries the agreement rows (`mrv2_dp`). Its phase is TARGET until this
step's target inputs were prepared, a draft phase after that (speculators sync after the
target forward). The draft-model speculator (`standalone_ar`) joins no DP sync of its own: it
reuses the target's agreement, so its forwards are recorded as collectives instead.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch

from runner_fsm import dp
from runner_fsm.integrations.vllm.runners import mrv2_dp
from runner_fsm.integrations.vllm.runners.base import (NAMES, ForwardInputs, RunnerAdapter, SkipDummyForward,
                                                       new_inputs, skipping_dummy, unwrap_method, wrap_method)

NO_STEP = -1


class MRV2Runner(RunnerAdapter):
    name = "mrv2"
    CLASSES = ("vllm.v1.worker.gpu.model_runner.GPUModelRunner",)
    ATTRS = ("model", "max_num_reqs", "cudagraph_manager", "input_buffers.input_ids", "input_buffers.positions",
             "input_buffers.query_start_loc", "input_buffers.seq_lens", "prepare_attn", "prepare_dummy_attn",
             "_dummy_run", "execute_model", "speculator", "pcp_manager", "req_states.draft_tokens")
    KV_ATTRS = ("block_tables.input_block_tables", "block_tables.slot_mappings", "cudagraph_manager.capture",
                "cudagraph_manager.run_fullgraph", "cudagraph_manager.graphs", "cudagraph_manager.dispatch")
    READS = {"runner": ("parallel_config", "pcp_manager_cls"),
             "speculator": ("propose", "num_speculative_steps", "model")}
    GRAPH_MANAGER = True
    # Speculators whose forwards join no DP sync (they reuse the target's agreement).
    SYNC_FREE_SPECULATORS = ("vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator.StandaloneARSpeculator",)

    def __init__(self, runner: Any):
        super().__init__(runner)
        self._prepared: tuple | None = None  # (input batch, block tables, slot mappings) of the next forward
        self.prepared_step = NO_STEP  # the step whose target inputs were prepared last
        self._step_of: Callable[[], int] = lambda: NO_STEP
        self._bases: tuple[torch.Tensor, ...] | None = None  # the persistent buffers, once the KV cache exists
        self._base_ptrs: list[int] = []  # their addresses
        self.pcp = None  # PCPEvidence under PCP, once the KV cache exists (`attach_kv`)
        self._pcp_fault: Callable[[str], bool] | None = None
        self._demote: Callable[[], bool] | None = None  # demote-graph-mode (`install_faults`)
        self._fast_pcp_layout = False  # install it on the PCP manager once that exists (`attach_kv`)
        self.DP_ROWS = len(mrv2_dp.sync_shape().rows)  # the rows of the installed release's DP sync

    def attach(self, step_of: Callable[[], int] | None = None, inputs: bool = True) -> None:
        """Observe each forward's inputs; `step_of()` names the worker's current step."""
        if step_of is not None:
            self._step_of = step_of
        if not inputs:
            return
        wrap_method(self.runner, "prepare_attn", lambda p, a, k: self._keep_prepared(p, a, k, dummy=False))
        wrap_method(self.runner, "prepare_dummy_attn", lambda p, a, k: self._keep_prepared(p, a, k, dummy=True))

    def problems(self, *, kv_cache: bool = False) -> list[str]:
        """With `kv_cache`, also every name the PCP evidence reads on the PCP manager, where the
        runner built one (PCP > 1): `pcp_evidence.manager_names()`, the installed release's."""
        problems = super().problems(kv_cache=kv_cache)
        manager = getattr(self.runner, "pcp_manager", None) if kv_cache else None
        if manager is not None:
            from runner_fsm.integrations.vllm.runners.pcp_evidence import manager_names

            # Looked up without running a property (`input_buffers` asserts until its buffers
            # exist): the first name of each path, on the instance or its class.
            missing = object()
            problems += [f"{type(manager).__qualname__}.{name} is missing ({self.name} runner's PCP manager)"
                         for name in dict.fromkeys(path.split(".")[0] for path in manager_names())
                         if inspect.getattr_static(manager, name, missing) is missing]
        return problems

    def attach_kv(self) -> None:
        """The PCP manager exists once the KV cache does: its evidence from here on."""
        from runner_fsm.integrations.vllm.runners.pcp_evidence import PCPEvidence  # imports this package

        manager = self.runner.pcp_manager
        if manager is not None and self.pcp is None:
            if self._fast_pcp_layout:  # before PCPEvidence wraps the methods it replaces
                self._install_fast_pcp_layout(manager)
            self.pcp = PCPEvidence(manager, self._step_of, self._pcp_fault)

    def _keep_prepared(self, prepare, args, kwargs, *, dummy: bool):
        self.inputs_written()
        out = prepare(*args, **kwargs)
        batch = args[0] if args else kwargs["input_batch"]
        self._prepared = (batch, out[0], out[1])
        self.prepared_step = self._step_of()
        if self.pcp is not None:
            (self.pcp.dummy_prepared if dummy else self.pcp.real_prepared)(batch, out[1])
        return out

    def pcp_evidence(self):
        return None if self.pcp is None else self.pcp.forward_evidence()

    def agreement_extra(self, step: int) -> dict:
        return {} if self.pcp is None else self.pcp.agreement_extra(step)

    # -- the probe's view of a forward

    def forward_inputs(self, args: dict, *, dummy: bool, capturing: bool) -> ForwardInputs:
        prepared, self._prepared = self._prepared, None
        if prepared is None:  # a forward without attention (memory profiling): the whole buffers
            ids = args.get("input_ids")
            ref = ids if isinstance(ids, torch.Tensor) else args.get("positions")
            num_tokens = int(ref.shape[-1]) if isinstance(ref, torch.Tensor) else 0
            return ForwardInputs(self._persistent_set(), self._persistent, num_tokens,
                                 min(num_tokens, self.runner.max_num_reqs), self.writes)
        batch, block_tables, slot_mappings = prepared
        views = (batch.input_ids, batch.positions, slot_mappings[0], batch.query_start_loc, batch.seq_lens,
                 block_tables[0])
        num_tokens, num_reqs = int(batch.num_tokens_after_padding), int(batch.num_reqs_after_padding)
        persistent = self._bases or self._persistent_set()
        # A plain loop, not all() over a generator: a Python frame per buffer costs, per forward.
        for view, ptr in zip(views, self._base_ptrs):
            if view.data_ptr() != ptr:  # PCP-local rows (the PCP manager's own buffers)
                return ForwardInputs(batch, lambda: dict(zip(NAMES, views)), num_tokens, num_reqs, self.writes)
        # The views begin the runner's own persistent buffers (no PCP): the probe keeps its views
        # of those across steps and reads the rows this forward reads.
        return new_inputs(ForwardInputs, (persistent, self._persistent, num_tokens, num_reqs, self.writes))

    # -- graphs (`CudaGraphManager` in `gpu/cudagraph_utils.py`): replays run no module hook

    def attach_graphs(self, captured: Callable[[Any], None], replaying: Callable[[Any], None]) -> None:
        manager = getattr(self.runner, "cudagraph_manager", None)
        if manager is None:  # made with the KV cache; none where graphs are off
            return

        def capture(original, args, kwargs):
            out = original(*args, **kwargs)
            for desc in manager.graphs:  # every graph it holds now, in capture order
                captured(desc)
            return out

        def run_fullgraph(original, args, kwargs):
            replaying(args[0] if args else kwargs["desc"])
            return original(*args, **kwargs)
        wrap_method(manager, "capture", capture)
        wrap_method(manager, "run_fullgraph", run_fullgraph)

    def graph_inputs(self, desc: Any, capturing: bool) -> ForwardInputs:
        """At a capture the persistent buffers' first rows of the descriptor's size (under PCP the
        PCP manager's, as the capture staged them: the views its replays read); before a replay
        what this step prepared (as `forward_inputs`)."""
        if not capturing and self._prepared is not None:
            return self.forward_inputs({}, dummy=False, capturing=False)
        num_tokens = int(desc.num_tokens)
        num_reqs = int(desc.num_reqs or min(num_tokens, self.runner.max_num_reqs))
        manager = self.runner.pcp_manager
        if manager is not None:  # a PCP graph reads the PCP manager's buffers, as its capture staged them
            ids, positions, slots, starts, lens = _pcp_buffers(manager)
            views = (ids[:num_tokens], positions[:num_tokens], slots[0, :num_tokens * int(manager.pcp_world_size)],
                     starts[:num_reqs + 1], lens[:num_reqs], self.runner.block_tables.input_block_tables[0][:num_reqs])
            return ForwardInputs(desc, lambda: dict(zip(NAMES, views)), num_tokens, num_reqs, self.writes)
        return ForwardInputs(self._persistent_set(), self._persistent, num_tokens, num_reqs, self.writes)

    def _replay_buffers(self) -> tuple[torch.Tensor, ...]:
        """Every persistent buffer a FULL graph reads: the runner's, and under PCP the PCP manager's."""
        manager = self.runner.pcp_manager
        return self._persistent_set() + (_pcp_buffers(manager) if manager is not None else ())

    def hold_replay_inputs(self) -> tuple:
        return self.writes, tuple(buf.clone() for buf in self._replay_buffers())

    def restore_replay_inputs(self, held: tuple) -> None:
        stamp, copies = held
        for buf, copy in zip(self._replay_buffers(), copies):
            buf.copy_(copy)
        self.writes = stamp

    def install_graph_veto(self, veto: Callable[[], bool]) -> None:
        manager = self.runner.cudagraph_manager

        def dispatch(original, args, kwargs):
            desc = original(*args, **kwargs)
            # The step's target forward only (its inputs not prepared yet: a drafter's graphs
            # have a manager of their own), where a FULL graph fits
            if desc.cg_mode.name == "FULL" and self.prepared_step != self._step_of() and veto():
                bound = inspect.signature(original).bind(*args, **kwargs)
                desc = dataclasses.replace(desc, cg_mode=type(desc.cg_mode).NONE,
                                           num_tokens=bound.arguments["num_tokens"],
                                           num_reqs=bound.arguments["num_reqs"], uniform_token_count=None,
                                           max_query_len=None)  # what `dispatch` gives where no graph fits
            return desc
        wrap_method(manager, "dispatch", dispatch)

    def _persistent_set(self) -> tuple[torch.Tensor, ...]:
        """The runner's persistent buffers in NAMES order (one tuple, made once)."""
        if self._bases is None:
            bufs, tables = self.runner.input_buffers, self.runner.block_tables
            self._bases = (bufs.input_ids, bufs.positions, tables.slot_mappings[0], bufs.query_start_loc,
                           bufs.seq_lens, tables.input_block_tables[0])
            self._base_ptrs = [buf.data_ptr() for buf in self._bases]
        return self._bases

    def _persistent(self) -> dict[str, torch.Tensor]:
        return dict(zip(NAMES, self._persistent_set()))

    # -- DP

    def install_dp(self, tap) -> Callable[[], None]:
        def phase() -> int:
            tap.follow()
            return dp.TARGET if self.prepared_step != tap.step_id else tap.draft_phase()
        tap.phase_source = phase
        manager = lambda: getattr(self.runner, "cudagraph_manager", None)  # noqa: E731 - made with the KV cache

        def eager_vote() -> bool:  # demote-graph-mode: asked in each DP sync, acts in the target's
            if self._demote is None:
                return False
            tap.follow()
            return self.prepared_step != tap.step_id and self._demote()
        undo_sync = mrv2_dp.install(tap, mrv2_dp.graph_decision(manager, tap.dp_rank), eager_vote)

        def undo() -> None:
            undo_sync()
            tap.phase_source = None
            for name in ("prepare_attn", "prepare_dummy_attn"):
                unwrap_method(self.runner, name)
        return undo

    def dp_group(self) -> tuple[Any, Any]:
        from vllm.distributed.parallel_state import get_dp_group

        return "cpu", get_dp_group().cpu_group  # where sync_cudagraph_and_dp_padding all-reduces

    def install_faults(self, *, skip_dummy_forward: Callable[[], bool], skip_draft_sync: Callable[[], bool],
                       draft_steps_mismatch: Callable[[], bool] | None = None,
                       pcp_fault: Callable[[str], bool] | None = None,
                       demote_graph_mode: Callable[[], bool] | None = None) -> None:
        runner = self.runner
        self._pcp_fault = pcp_fault  # the PCP manager's faults act there (`runners/pcp/evidence.py`), once it exists
        self._demote = demote_graph_mode  # asked in the target DP sync (`install_dp`)

        def prepare_unless_skipped(prepare, args, kwargs):
            out = prepare(*args, **kwargs)  # past the dummy's DP agreement, before its forward
            if skip_dummy_forward():
                raise SkipDummyForward
            return out
        wrap_method(runner, "prepare_dummy_attn", prepare_unless_skipped)
        wrap_method(runner, "_dummy_run", skipping_dummy)
        speculator = runner.speculator
        if speculator is not None:
            def faulty_dummy_propose(propose, args, kwargs):
                if kwargs.get("dummy_run"):  # the idle replica's draft (vLLM's _dummy_run passes keywords)
                    if skip_draft_sync():
                        return None
                    if draft_steps_mismatch is not None and draft_steps_mismatch():
                        # vLLM's own multi-step path, one draft step more than its peers run
                        kwargs["num_speculative_tokens"] = int(speculator.num_speculative_steps) + 1
                return propose(*args, **kwargs)
            wrap_method(speculator, "propose", faulty_dummy_propose)

    def install_draft_gate(self, gate) -> str | None:
        """Around the speculator's `propose` (a busy step's `sample_tokens` and an idle step's
        `_dummy_run` each call it once a step, before any draft forward or draft DP sync). A
        skipped busy pass keeps the requests' previous drafts, as vLLM's own tensor holds them."""
        runner = self.runner
        speculator = runner.speculator
        if speculator is None:
            return "no speculator"

        def gated(propose, args, kwargs):
            dummy = bool(kwargs.get("dummy_run"))
            asked = kwargs.get("num_speculative_tokens")  # 0: every replica agreed to skip drafts (0.33)
            steps = int(speculator.num_speculative_steps) if asked is None else int(asked)
            # vLLM's own 0 is logged as 0 and still runs (0.33's propose then writes the draft
            # model's KV cache without sampling: skip_sample); only the gate's 0 skips the pass
            if gate(dummy, steps) == 0 and steps > 0:
                if dummy:
                    return None
                return runner.req_states.draft_tokens[args[0].idx_mapping].clone()  # args[0]: the input batch
            return propose(*args, **kwargs)
        wrap_method(speculator, "propose", gated)
        return None

    def install_fast_pcp_layout(self) -> dict:
        """On the PCP manager instance this runner builds with the KV cache (`attach_kv`), never on
        its class, which vLLM shares: checked here, before the manager exists, installed there."""
        from runner_fsm.integrations.vllm.runners.pcp_layout import check_fast_pcp_layout

        par = self.runner.parallel_config
        if int(getattr(par, "prefill_context_parallel_size", 1) or 1) <= 1:
            return {"installed": False, "reason": "PCP 1: the runner builds no PCP manager"}
        description = check_fast_pcp_layout(self.runner.pcp_manager_cls,
                                            int(getattr(par, "decode_context_parallel_size", 1) or 1))
        self._fast_pcp_layout = description["installed"]
        return description

    def _install_fast_pcp_layout(self, manager) -> None:
        from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

        description = install_fast_pcp_layout(manager)
        if not description["installed"]:  # the log's first record said it would be
            raise RuntimeError(f"fast_pcp_layout: not installed on the PCP manager: {description['reason']}")

    def install_draft_dp_sync(self, dp_size: int, pcp_size: int) -> dict:
        """Under DP x PCP the speculator's reuse of the target's DP sync fails in vLLM 0.32 (`draft_dp_sync`)."""
        from runner_fsm.integrations.vllm.common import schema
        from runner_fsm.integrations.vllm.runners import draft_dp_sync

        spec = self.runner.speculator
        if spec is None:
            return {"installed": False, "reason": "no speculator"}
        return draft_dp_sync.install(spec, dp_size=dp_size, pcp_size=pcp_size, version=schema.installed_version())

    def draft_model(self) -> torch.nn.Module | None:
        spec = self.runner.speculator
        if spec is None or not any(f"{c.__module__}.{c.__qualname__}" in self.SYNC_FREE_SPECULATORS
                                   for c in type(spec).__mro__):
            return None
        model = getattr(spec, "model", None)
        return model if isinstance(model, torch.nn.Module) else None


def _pcp_buffers(manager) -> tuple[torch.Tensor, ...]:
    """The PCP manager's persistent buffers a PCP graph reads, whole, in NAMES order (the block
    table is the runner's): input_ids, positions, the gathered KV slot mappings ([groups, rows]),
    query_start_loc, seq_lens."""
    bufs = manager.input_buffers
    return bufs.input_ids, bufs.positions, manager._gathered_kv_slot_mappings, bufs.query_start_loc, bufs.seq_lens
