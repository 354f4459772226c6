"""Faults at a FULL graph's replay, through vLLM (`inject.GRAPH_KINDS`): what `FSMWorker` installs
when the worker option `inject` names one, whatever the job's shape.

They act where a graph manager replays from Python calls of its own (Model Runner V2's
`CudaGraphManager`, on a device or under the device emulation); V1 replays none there, so on
V1 they never fire, and the worker says so at shutdown.

- `skip-input-refresh@replica=R,step=S`: the step's inputs never reach the persistent buffers
  its graph replay reads, so the replay reads what the step before left there (the bytes held
  when the step began, written back before the replay). The probe's write stamp is then that of
  the preparation that wrote those bytes: replay names `stale_buffer_replay` at R, S from the
  `buffers` record alone, and the replica samples from the previous step's inputs.
- `rank-graph-mode@replica=R,step=S,rank=K`: rank K's graph manager finds no graph for the step's
  batch, so vLLM runs that rank's forward eager while its peers replay (SGLang #31566: idle
  ranks took another capture mode). Its decisions say `graph=0` where its peers' say the size.
  With DP > 1 vLLM's DP sync carries rank K's eager request to its DP peers (the same rank of
  every replica), as it would for a real rank of that kind.
"""

from __future__ import annotations

from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.common import inject
from runner_fsm.integrations.vllm.common.inject import VLLMInjector


class GraphFaults:
    """The injected fault of one graph kind on one worker (see the module docstring)."""

    def __init__(self, injection, recorder, *, dp_rank: int, rank: int):
        """`rank`: this worker's rank within its replica, in vLLM's order (what `rank=K` names)."""
        self.injection, self.recorder = injection, recorder
        self.adapter = None  # the runner's adapter, once its graph manager exists (`attach`)
        self.injector = VLLMInjector(injection, dp_rank, rank=rank,
                                     on_fire=lambda: recorder.audit.injected(recorder.step_id, str(injection)))
        self._held: tuple | None = None  # (step, inputs held at its start), for skip-input-refresh

    @classmethod
    def for_worker(cls, worker) -> "GraphFaults | None":
        opts = worker.fsm_options
        injection = inject.parse(opts.inject) if opts.inject else None
        if injection is None or injection.kind not in inject.GRAPH_KINDS:
            return None
        place = worker.place
        sizes = place.sizes
        rank = place.global_rank - place.coords.dp * sizes.pp * sizes.pcp * sizes.tp
        return cls(injection, worker.recorder, dp_rank=place.coords.dp, rank=rank)

    def attach(self, adapter) -> None:
        """Once the graph manager exists (with the KV cache): rank-graph-mode's place in it. A
        runner that replays no graph from Python calls of its own (V1) cannot take these faults:
        a `ConfigError` at start-up, rather than a run that tests nothing."""
        if not adapter.GRAPH_MANAGER:
            raise ConfigError(f"inject {self.injection}: {self.injection.kind} acts where a graph manager replays"
                              f" FULL graphs from Python calls of its own (Model Runner V2); the {adapter.name}"
                              " runner has none here")
        self.adapter = adapter
        if self.injection.kind == "rank-graph-mode":
            adapter.install_graph_veto(self._veto)

    def began(self, step_id: int, kind: str) -> None:
        """Step `step_id` began as a `kind` step (prefill, decode, idle): the inputs the step
        before left are held now, at the injection's step, before this step writes its own."""
        self.injector.saw(step_id, kind)
        i = self.injection
        if i.kind == "skip-input-refresh" and i.step == step_id and i.replica == self.injector.dp_rank \
                and self.adapter is not None:
            self._held = (step_id, self.adapter.hold_replay_inputs())

    def before_replay(self) -> None:
        """Right before a graph replay of the current step (its inputs are written by now)."""
        held, step = self._held, self.recorder.step_id
        if held is not None and held[0] == step and self.injector.due("skip-input-refresh", step):
            self._held = None
            self.adapter.restore_replay_inputs(held[1])

    def _veto(self) -> bool:
        """Asked where the graph manager picks the step's target graph: True runs it eager."""
        rec = self.recorder
        return rec.in_step and self.injector.due("rank-graph-mode", rec.step_id)

    def never_fired(self, last_step: int) -> str | None:
        return self.injector.never_fired(last_step)
