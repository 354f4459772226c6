"""What the worker needs to know of one vLLM model runner: the runner adapter's interface.

`FSMWorker` wraps whatever model runner vLLM built (V1's `GPUModelRunner`/`CPUModelRunner`,
Model Runner V2 in `vllm/v1/worker/gpu/`, vLLM-Ascend's NPU runners). The worker, the recorder,
the probe and the DP support never name a runner's attributes; they ask its adapter (DESIGN
section 10):

- `forward_inputs`: the persistent buffers the forward about to run reads, and how many rows;
- `install_dp(tap)`: route the runner's DP sync through the agreement tap (rows in the same
  collective, phases tagged), returning the undo;
- `dp_group()`: the (device, group) of that collective, for an abort sent from outside it;
- `install_faults(...)`: where the injected DP faults act (skip the dummy forward, skip the
  drafter's dummy run, run it with one draft step more);
- `install_draft_dp_sync(...)`: the drafter's own DP syncs where vLLM's are known wrong;
- `draft_model()`: the drafter's model, whose forwards are collectives of their own where the
  drafter joins no DP sync (MRV2's draft-model speculator reuses the target's agreement);
- `problems()`: every name above that the live runner (not only vLLM's base class) lacks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

# The probe's buffers, in this order (see probe.py).
TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")
REQUEST_BUFFERS = ("query_start_loc", "seq_lens", "block_table")
NAMES = TOKEN_BUFFERS + REQUEST_BUFFERS


class ForwardInputs(NamedTuple):
    """What one target forward reads: `buffers` (by NAMES) holds whole persistent buffers or
    views from their first row; the forward reads `num_tokens` rows of the token buffers and
    `num_reqs` rows of the request buffers (`query_start_loc`: one more). `key` changes when
    the buffer objects may have changed (the probe rebuilds its cached views then). `stamp`
    counts the runner's input preparations so far: a forward whose stamp did not move reads
    inputs nobody wrote for it (vLLM writes them through numpy views, which move no torch
    version counter, and equal bytes are no evidence either way: two dummies are equal)."""

    key: Any
    buffers: Callable[[], dict[str, torch.Tensor]]
    num_tokens: int
    num_reqs: int
    stamp: int = 0


# `ForwardInputs` made without its generated `__new__` (a Python-level call, once per forward):
# `new_inputs(ForwardInputs, (key, buffers, num_tokens, num_reqs, stamp))`, all five given.
new_inputs = tuple.__new__


class SkipDummyForward(Exception):
    """Raised past the dummy's DP agreement to return without its forward (injected fault)."""


class RunnerAdapter:
    """One vLLM model runner as the worker sees it; subclasses name the runner's parts."""

    name = "?"
    # Qualified names of runner classes this adapter serves: one of them in the live class's MRO.
    CLASSES: tuple[str, ...] = ()
    # Attribute paths read on the live runner (dotted; `[0]` indexes), checked at load time.
    ATTRS: tuple[str, ...] = ()
    # Those that exist only once the KV cache is initialised (checked before warm-up).
    KV_ATTRS: tuple[str, ...] = ()
    # Names read on the runner's parts beyond ATTRS, by part ("runner", "drafter", "speculator"):
    # not checked at load time (read only where a feature needs them), listed so every name an
    # adapter reads is in its tables (tests/test_vllm_rooms.py).
    READS: dict[str, tuple[str, ...]] = {}
    GRAPH_MANAGER = False  # FULL graphs picked, captured and replayed by Python calls of its own (`attach_graphs`)
    DP_ROWS = 0  # rows of vLLM's own DP sync tensor (the agreement rows follow them)
    # Where the runner partitions batches over PCP ranks itself: its evidence (`runners/pcp/evidence.py`
    # reads it; the worker's forward hook skips that call while this is None).
    pcp: Any = None

    def __init__(self, runner: Any):
        self.runner = runner
        self.writes = 0  # the runner's input preparations seen so far (`ForwardInputs.stamp`)

    def inputs_written(self) -> None:
        """The runner is (re)writing its persistent inputs for the next forward."""
        self.writes += 1
        # What the next target forward's `expert`/`forward` record carries (the PCP evidence:
        # `ctx`, `batch`, `graph`), set by the worker's forward pre-hook.
        self.forward_extra: dict | None = None

    def take_forward_extra(self) -> dict | None:
        extra, self.forward_extra = self.forward_extra, None
        return extra

    @classmethod
    def serves(cls, runner_cls: type) -> bool:
        return any(f"{c.__module__}.{c.__qualname__}" in cls.CLASSES for c in runner_cls.__mro__)

    def problems(self, *, kv_cache: bool = False) -> list[str]:
        """Every attribute of ATTRS (with `kv_cache`: of KV_ATTRS) the live runner lacks."""
        return [f"{type(self.runner).__qualname__}.{path} is missing ({self.name} runner)"
                for path in (self.KV_ATTRS if kv_cache else self.ATTRS) if not has_path(self.runner, path)]

    def model(self) -> Any:
        """The target model the runner calls each forward (a module, or vLLM's graph wrapper)."""
        return self.runner.model

    def check_dp_hooks(self) -> None:
        """Before `install_dp`: the vLLM internals this adapter's DP hooks patch, checked by name,
        signature and source (`hooks.DP_HOOKS`); `VLLMSchemaError` naming each one missing."""
        from runner_fsm.integrations.vllm.runners.hooks import check_dp_hooks

        check_dp_hooks(self.name)

    def attach(self, step_of: Callable[[], int] | None = None, inputs: bool = True) -> None:
        """Once the model is loaded: whatever the adapter must observe per step; `step_of()`
        names the worker's current step (-1 outside steps). `inputs=False`: nothing reads the
        runner's input preparations (no fingerprints, PCP evidence, DP or peers): not observed."""

    def attach_kv(self) -> None:
        """Once the KV cache exists (what vLLM builds with it, e.g. MRV2's PCP manager)."""

    def attach_graphs(self, captured: Callable[[Any], None], replaying: Callable[[Any], None]) -> None:
        """Where the runner's graph manager captures and replays FULL graphs from Python calls of
        its own: `captured(desc)` after each capture, `replaying(desc)` before each replay. V1
        replays through `CUDAGraphWrapper.__call__`, which the forward hook sees: nothing here."""

    def graph_inputs(self, desc: Any, capturing: bool) -> ForwardInputs:
        """The persistent inputs a graph of descriptor `desc` reads (see `attach_graphs`)."""
        raise NotImplementedError

    # -- graph faults (`graph_faults`): where the runner's graph manager replays from Python

    def hold_replay_inputs(self) -> tuple:
        """(the write stamp, copies of every persistent buffer a graph replay reads), as they are now."""
        raise NotImplementedError(f"the {self.name} runner replays no graph from Python calls of its own")

    def restore_replay_inputs(self, held: tuple) -> None:
        """Write back what `hold_replay_inputs` held: the buffers then hold that preparation's
        bytes, so the write stamp is that preparation's again (the probe reads it as `version`)."""
        raise NotImplementedError(f"the {self.name} runner replays no graph from Python calls of its own")

    def install_graph_veto(self, veto: Callable[[], bool]) -> None:
        """Ask `veto()` where the graph manager picked a FULL graph for a step's target forward:
        True runs that forward eager instead (as if no graph fit the batch)."""
        raise NotImplementedError(f"the {self.name} runner picks no graph from Python calls of its own")

    def pcp_evidence(self) -> tuple[dict | None, dict] | None:
        """(PCP buffers' fingerprints, {ctx, batch}) of the forward about to run, where the
        runner partitions batches over PCP ranks itself; None otherwise."""
        return None

    def agreement_extra(self, step: int) -> dict:
        """Fields for this step's TARGET agreement record (the dispatch count's inputs)."""
        return {}

    def forward_inputs(self, args: dict, *, dummy: bool, capturing: bool) -> ForwardInputs:
        raise NotImplementedError

    def install_dp(self, tap) -> Callable[[], None]:
        raise NotImplementedError

    def dp_group(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def install_faults(self, *, skip_dummy_forward: Callable[[], bool], skip_draft_sync: Callable[[], bool],
                       draft_steps_mismatch: Callable[[], bool] | None = None,
                       pcp_fault: Callable[[str], bool] | None = None,
                       demote_graph_mode: Callable[[], bool] | None = None) -> None:
        raise NotImplementedError

    def draft_model(self) -> torch.nn.Module | None:
        """The drafter's model when its forwards are to be recorded as collectives (None:
        the drafter's DP syncs already carry the agreement)."""
        return None

    def lacks_pp_buffers(self, vllm_config: Any) -> bool:
        """Whether this rank's runner will lack the buffers a later pipeline stage receives into
        (the worker then supplies them once the model exists: `supply_pp_buffers`)."""
        return False

    def supply_pp_buffers(self) -> bool:
        return False

    def install_fast_pcp_layout(self) -> dict:
        """The `fast_pcp_layout` option: what was installed, or why not (recorded as is)."""
        return {"installed": False, "reason": f"the {self.name} runner has no PCP manager to speed up"}

    def install_draft_dp_sync(self, dp_size: int, pcp_size: int) -> dict:
        """The drafter's own DP syncs where the runner's reuse of the target's is known to fail
        (`draft_dp_sync`): what was installed, or why not (recorded as is)."""
        return {"installed": False, "reason": f"the {self.name} runner runs no PCP draft prefill"}

    def install_draft_gate(self, gate: Callable[[bool, int], int]) -> str | None:
        """Ask `gate(dummy, steps)` before each drafter pass, ahead of any of its collectives:
        it returns the drafter steps to run (0: the pass is skipped). None when installed, else
        why not (the drafter's gate is then not logged: `replica_check`)."""
        return f"the {self.name} runner's drafter is not gated here"

    def describe(self) -> dict:
        """For the log's first record: which runner and adapter."""
        cls = type(self.runner)
        return {"runner": self.name, "runner_class": f"{cls.__module__}.{cls.__qualname__}"}


def has_path(obj: Any, path: str) -> bool:
    """Whether `obj` has the dotted attribute `path` (`[0]` indexes)."""
    try:
        for part in path.split("."):
            name, _, index = part.partition("[")
            obj = getattr(obj, name)
            if index:
                obj = obj[int(index.rstrip("]"))]
    except (AttributeError, IndexError, TypeError, KeyError):
        return False
    return True


def wrap_method(obj: Any, name: str, around: Callable[[Callable, tuple, dict], Any]) -> None:
    """Make `obj.name(*a, **k)` call `around(original, a, k)`: an instance attribute over the
    bound method, so the runner's class (and every other instance) stays untouched."""
    method = getattr(obj, name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        return around(method, args, kwargs)
    setattr(obj, name, wrapped)


def unwrap_method(obj: Any, name: str) -> None:
    obj.__dict__.pop(name, None)


def skipping_dummy(run_dummy: Callable, args: tuple, kwargs: dict):
    """Around a runner's dummy run: a `SkipDummyForward` raised inside it ends it quietly."""
    try:
        return run_dummy(*args, **kwargs)
    except SkipDummyForward:
        return None
