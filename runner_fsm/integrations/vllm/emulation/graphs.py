"""FULL graphs on the CPU: a captured forward, rerun over the buffers it was bound to.

A device graph is the kernels one forward launched, bound to the addresses it read and wrote;
its replay reruns them over whatever those buffers hold now, without running Python. Here:

- vLLM's graph manager (`v1/worker/gpu/cudagraph_utils.py`, MRV2) makes each descriptor's
  forward with `create_forward_fn(desc, warmup)` (frozen attention metadata, the persistent
  input views, the static output buffer) and calls it inside `torch.cuda.graph(graph, ...)`.
  `install()` hands that module a `torch` whose `cuda.CUDAGraph` is this emulation's graph class
  and whose `cuda.graph` marks the graph being captured, and wraps `CudaGraphManager.capture` so
  that a forward called while a graph is being captured binds itself to it (with the CPU
  attention refreshers of the metadata it was made with: `cpu_attention`).
- `replay()` refreshes that host metadata, then reruns the bound forward with every module
  hook of the silenced models off (`hooks_off`): as on a device, no Python the worker
  installed runs inside a replay, so its evidence must come from the graph manager's calls.

A graph class is anything with `bind(forward, refreshers)` and `replay()`:
`RUNNER_FSM_EMULATED_GRAPH=module:Class` names another one (the tests' minimal stand-in), in
every process. vLLM 0.32's names are checked before anything is replaced (`check`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
import weakref
from typing import Any, Callable, Iterator

import torch

from runner_fsm.integrations.vllm.emulation import cpu_attention
from runner_fsm.named import named

GRAPH_ENV = "RUNNER_FSM_EMULATED_GRAPH"
MANAGER_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
# What `install` replaces or wraps, checked against the installed vLLM first.
NAMES = (f"{MANAGER_MODULE}.torch", f"{MANAGER_MODULE}.graph_capture", f"{MANAGER_MODULE}.CudaGraphManager.capture",
         f"{MANAGER_MODULE}.CudaGraphManager.run_fullgraph", cpu_attention.BUILDER + ".build",
         cpu_attention.MLA_BACKEND + ".get_builder_cls")

_capturing = threading.local()  # .graph: the graph whose capture is open on this thread
# The models whose hooks are off during a replay; weak, so a closed engine's model is not kept.
_silenced: weakref.WeakSet = weakref.WeakSet()


class EmulatedGraph:
    """`torch.cuda.CUDAGraph` on the CPU: one forward, bound at capture, rerun at replay."""

    def __init__(self, *_args: Any, **_kwargs: Any):
        self.forward: Callable[[], Any] | None = None
        self.refreshers: tuple[Callable[[], None], ...] = ()
        self.replays = 0

    def bind(self, forward: Callable[[], Any], refreshers: tuple[Callable[[], None], ...]) -> None:
        if self.forward is not None:
            raise RuntimeError("emulated graph: a second forward captured into one graph")
        self.forward, self.refreshers = forward, refreshers

    def replay(self) -> None:
        if self.forward is None:
            raise RuntimeError("emulated graph: replay of a graph that captured no forward")
        for refresh in self.refreshers:
            refresh()
        with hooks_off():
            self.forward()
        self.replays += 1

    def reset(self) -> None:
        self.forward, self.refreshers = None, ()


@contextlib.contextmanager
def hooks_off() -> Iterator[None]:
    """Every forward hook of the silenced models off, as in a device replay. torch has no public
    way to suspend a module's hooks; it reads the module's hook dicts (`_forward_pre_hooks`,
    `_forward_hooks`, in every torch 2.x) on each call, so emptied for the replay and put back
    after, its call runs the forward alone."""
    saved = []
    try:
        for model in _silenced:
            for module in model.modules():
                if module._forward_pre_hooks or module._forward_hooks:
                    saved.append((module, module._forward_pre_hooks, module._forward_hooks))
                    module._forward_pre_hooks, module._forward_hooks = type(module._forward_pre_hooks)(), \
                        type(module._forward_hooks)()
        yield
    finally:
        for module, pre, post in saved:
            module._forward_pre_hooks, module._forward_hooks = pre, post


def silence(model: torch.nn.Module) -> None:
    """`model`'s hooks are off inside every replay (the emulated worker's model, before capture)."""
    _silenced.add(model)


@contextlib.contextmanager
def capture_into(graph: Any, *_args: Any, **_kwargs: Any) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool, stream=...)`: the forward called inside binds to `graph`."""
    _capturing.graph = graph
    try:
        yield
    finally:
        _capturing.graph = None


@contextlib.contextmanager
def graph_capture(device: torch.device) -> Iterator[Any]:
    """vLLM's `parallel_state.graph_capture` without its communicators' capture modes: it puts
    each group's device communicator (custom all-reduce, ...) into graph mode and asserts a CUDA
    or XPU one, where the CPU's (gloo, shared memory) have no such mode. The context it yields
    (the capture stream) is the same."""
    from vllm.distributed.parallel_state import GraphCaptureContext

    yield GraphCaptureContext(torch.cuda.Stream(device=device))


def graph_class() -> type:
    spec = os.environ.get(GRAPH_ENV, "")
    if not spec:
        return EmulatedGraph
    return named(spec)


class _Namespace:
    """A module seen through one replaced name (`__getattr__` gives the rest)."""

    def __init__(self, real: Any, **names: Any):
        self._real = real
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def check() -> list[str]:
    """The names `install` needs that the installed vLLM lacks."""
    missing = []
    for path in NAMES:
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for part in parts[cut:]:
                    obj = getattr(obj, part)
            except AttributeError:
                missing.append(path)
            break
        else:
            missing.append(path)
    return missing


def written_for(version: str) -> bool:
    """The emulation replaces names inside vLLM: only on the release line it was written for
    (`schema.WRITTEN_AGAINST`'s major.minor); `install` refuses another, `vllm-check` says so."""
    from runner_fsm.integrations.vllm.common.schema import WRITTEN_AGAINST

    return version.split(".")[:2] == WRITTEN_AGAINST.split(".")[:2]


def install() -> dict:
    """Graphs emulated in this process (idempotent); what was done, for the job record."""
    module = importlib.import_module(MANAGER_MODULE)
    manager = module.CudaGraphManager
    if getattr(manager.capture, "_runner_fsm_emulation", False):
        return {"graphs": "installed", "graph_class": _class_name(graph_class())}
    # It replaces names inside vLLM (no public hook makes a CPU graph): only on the vLLM it was
    # written and checked against, each name present.
    from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError
    from runner_fsm.integrations.vllm.common.schema import WRITTEN_AGAINST, installed_version

    version = installed_version()
    if not written_for(version):
        raise VLLMSchemaError(f"the device emulation was written against vLLM {WRITTEN_AGAINST}; vLLM {version}"
                              " is installed: unset RUNNER_FSM_EMULATE_DEVICE")
    missing = check()
    if missing:
        raise VLLMSchemaError("the device emulation needs names this vLLM lacks: " + ", ".join(missing))
    # Only this module's view of torch changes: `torch.cuda` elsewhere stays torch's own. The
    # graph class is looked up at each graph made (`graph_class`), as the environment names it.
    module.torch = _Namespace(torch, cuda=_Namespace(torch.cuda, CUDAGraph=new_graph, graph=capture_into))
    module.graph_capture = graph_capture
    manager.capture = _binding(manager.capture)
    cpu_attention.install()
    return {"graphs": "installed", "graph_class": _class_name(graph_class())}


def new_graph(*args: Any, **kwargs: Any) -> Any:
    return graph_class()(*args, **kwargs)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _binding(capture: Callable) -> Callable:
    """`CudaGraphManager.capture` whose forwards bind to the graph being captured when called."""
    @functools.wraps(capture)
    def capture_binding(self, create_forward_fn, *args: Any, **kwargs: Any):
        def create(desc: Any, warmup: bool):
            with cpu_attention.collect() as refreshers:
                forward_fn = create_forward_fn(desc, warmup)

            def forward(mode: Any) -> Any:
                graph = getattr(_capturing, "graph", None)
                if graph is not None:
                    graph.bind(functools.partial(forward_fn, mode), tuple(refreshers))
                return forward_fn(mode)
            return forward
        return capture(self, create, *args, **kwargs)

    capture_binding._runner_fsm_emulation = True
    return capture_binding
