"""Captured decode graphs, and the check that a replay reads refreshed buffers.

A graph reads its inputs from the persistent buffers by address. Before every replay the
runner checks that (1) every buffer still has the storage and shape it had at capture and
(2) every buffer was written since the step began: the first `idle_dummy` after a real
batch must refresh the buffers for the dummy, or the graph would replay the real batch.
Either failure is a `StaleBufferError` and nothing runs.

Back-ends: `static` (CPU) re-runs the forward reading nothing but the persistent buffers,
so stale-buffer faults reproduce without an accelerator; `cuda` captures
`torch.cuda.CUDAGraph`s; `npu` uses `torch_npu`'s NPUGraph, imported only when asked for.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping

import torch

from runner_fsm.errors import ConfigError, RunnerError, StaleBufferError
from runner_fsm.pcp.buffers import BufferFingerprint, PersistentBuffers
from runner_fsm.rules.checks import moved_storage, stale_inputs

BACKENDS = ("static", "cuda", "npu")
Fingerprints = Mapping[str, BufferFingerprint]


HostStep = Callable[[int], None]  # called with the step id
_capturing = threading.local()  # .steps: the host steps of the graph being captured


def host_step(fn: HostStep, step_id: int | None = None) -> None:
    """Run host work of a forward now, and, while a device graph is being captured, before
    every replay of that graph: a captured graph replays device work only, so host-side
    checks (the expert header exchange) would otherwise run once at capture and never again."""
    steps = getattr(_capturing, "steps", None)
    if steps is not None:
        steps.append(fn)
    fn(-1 if step_id is None else step_id)


@contextlib.contextmanager
def capturing_host_steps() -> Iterator[list[HostStep]]:
    """Collect the host steps of the forward captured inside (this thread only)."""
    _capturing.steps = []
    try:
        yield _capturing.steps
    finally:
        _capturing.steps = None


def backend_for(device: torch.device) -> str:
    return {"cuda": "cuda", "npu": "npu"}.get(device.type, "static")


class GraphRunner:
    """Decode graphs of one replica, one per capture size, reading only `buffers`.

    `forward(num_tokens)` must read its inputs from `buffers` alone and return a tensor.
    """

    def __init__(self, buffers: PersistentBuffers, forward: Callable[[int], torch.Tensor],
                 *, backend: str = "static", audit=None):
        if backend not in BACKENDS:
            raise ConfigError(f"graph backend must be one of {BACKENDS}, got {backend!r}")
        self.buffers = buffers
        self.backend = backend
        self._forward = forward
        self._audit = audit
        self._captured: dict[int, Fingerprints] = {}
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._host_steps: dict[int, list[HostStep]] = {}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def can_replay(self, size: int) -> bool:
        """Whether a graph of exactly `size` rows was captured."""
        return size in self._captured

    def capture(self, sizes, *, step_id: int | None = None) -> None:
        for size in sizes:
            self.buffers.write_dummy(1, size)  # capture reads a well-formed dummy
            if self.backend == "static":
                self._outputs[size] = self._forward(size)
            else:
                self._graphs[size], self._outputs[size], self._host_steps[size] = _capture_device_graph(
                    self.backend, lambda: self._forward(size))
            fingerprint = self.buffers.fingerprint()
            self._captured[size] = fingerprint
            if self._audit is not None:
                self._audit.graph(step_id, "capture", num_tokens=size, backend=self.backend)
                self._audit.buffers(step_id, "capture", fingerprint)

    def replay(self, size: int, *, step_id: int, since: Fingerprints,
               last_real: Fingerprints | None = None) -> torch.Tensor:
        """Replay the graph of `size`; `since` is the fingerprint taken when the step began,
        `last_real` the inputs of the last real batch (with content digests)."""
        if size not in self._captured:
            raise RunnerError(f"step {step_id}: no graph captured for {size} tokens (have {self.sizes})")
        now = self.buffers.fingerprint(content=True)
        if self._audit is not None:  # before the check: a refused replay is on record too
            self._audit.buffers(step_id, "replay", now)
        check_replay(self._captured[size], since, now, step_id=step_id, last_real=last_real)
        if self._audit is not None:
            self._audit.graph(step_id, "replay", num_tokens=size)  # the backend: its capture's record
        if self.backend == "static":
            return self._forward(size)
        for run_on_host in self._host_steps[size]:
            run_on_host(step_id)
        self._graphs[size].replay()
        return self._outputs[size]


def check_replay(captured: Fingerprints, since: Fingerprints, now: Fingerprints, *, step_id,
                 last_real: Fingerprints | None = None) -> None:
    """Raise `StaleBufferError` when storage moved since capture or the inputs are stale
    (the rules of `rules.checks`, which replay applies to the logged fingerprints too)."""
    moved = moved_storage(captured, now)
    if moved:
        details = ", ".join(f"{n} {captured[n].ptr:#x}->{now[n].ptr:#x}" for n in moved)
        raise StaleBufferError(
            f"step {step_id}: graph replay refused: storage of {details} differs from capture"
        )
    check_refreshed(since, now, step_id=step_id, what="graph replay", last_real=last_real)


def check_refreshed(since: Fingerprints, now: Fingerprints, *, step_id, what: str = "forward",
                    last_real: Fingerprints | None = None) -> None:
    """Raise `StaleBufferError` unless the inputs were written for this step (`since`: the
    fingerprint at step start) and differ from the last real batch's (`last_real`)."""
    problem = stale_inputs(now, since, last_real)
    if problem:
        raise StaleBufferError(f"step {step_id}: {what} refused: {problem}")


def _capture_device_graph(backend: str, run: Callable[[], torch.Tensor]):
    if backend == "cuda":
        graph_cls, stream_fn = torch.cuda.CUDAGraph, torch.cuda.Stream
        graph_ctx, current = torch.cuda.graph, torch.cuda.current_stream
    else:
        import torch_npu  # noqa: F401  (only on the NPU path: it needs Ascend's CANN)

        graph_cls, stream_fn = torch.npu.NPUGraph, torch.npu.Stream
        graph_ctx, current = torch.npu.graph, torch.npu.current_stream
    side = stream_fn()
    side.wait_stream(current())
    with torch.cuda.stream(side) if backend == "cuda" else torch.npu.stream(side):
        run()  # warm-up outside the graph: lazy initialisation must not be captured
    current().wait_stream(side)
    graph = graph_cls()
    with capturing_host_steps() as host_steps, graph_ctx(graph):
        output = run()
    return graph, output, host_steps
