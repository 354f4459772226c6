"""Graph classes the device tests hand the emulation (`RUNNER_FSM_EMULATED_GRAPH`): test set-up.

`MinimalGraph` is the least a device graph is, written apart from the emulation's own class:
the forward bound at capture, rerun at replay over the same buffers (after the host metadata
refresh it is given), every module hook off. It counts its replays, so a test can hold the
log's replay records against the replays that ran. `FailingGraph` fails its capture."""

from __future__ import annotations

from runner_fsm.integrations.vllm.emulation.graphs import hooks_off


class MinimalGraph:
    replays = 0  # every replay of every instance, in this process

    def __init__(self, *_args, **_kwargs):
        self._run = None

    def bind(self, forward, refreshers) -> None:
        self._run = (forward, refreshers)

    def replay(self) -> None:
        forward, refreshers = self._run
        for refresh in refreshers:
            refresh()
        with hooks_off():
            forward()
        MinimalGraph.replays += 1


class FailingGraph(MinimalGraph):
    def bind(self, forward, refreshers) -> None:
        raise RuntimeError("injected capture failure")
