"""The device emulation's parts that need no vLLM: its switch and its graph's semantics.

The emulation's graph must behave as a device graph does, or the device tests prove nothing:
a replay reruns the bound forward over whatever the bound buffers hold now (so a stale buffer
gives a stale output), and no module hook runs inside it (a device runs no Python)."""

from __future__ import annotations

import pytest
import torch

from runner_fsm.integrations.vllm.emulation import graphs, plugin


def test_the_platform_plugin_answers_only_when_asked(monkeypatch):
    """Never on by default: vLLM keeps its own platform unless RUNNER_FSM_EMULATE_DEVICE is set."""
    monkeypatch.delenv("RUNNER_FSM_EMULATE_DEVICE", raising=False)
    assert plugin.platform() is None
    monkeypatch.setenv("RUNNER_FSM_EMULATE_DEVICE", "0")
    assert plugin.platform() is None
    monkeypatch.setenv("RUNNER_FSM_EMULATE_DEVICE", "1")
    assert plugin.platform() == "runner_fsm.integrations.vllm.emulation.platform.EmulatedDevicePlatform"


def test_replay_reads_the_bound_buffers_as_they_are_now():
    """Fails if a replay returned the capture's result (a cached output), not a rerun."""
    buf, out = torch.tensor([1.0, 2.0]), torch.zeros(2)
    graph = graphs.EmulatedGraph()
    refreshed = []
    with graphs.capture_into(graph):
        graph.bind(lambda: out.copy_(buf * 2), (lambda: refreshed.append(1),))
    buf.copy_(torch.tensor([5.0, 7.0]))  # the runner writes the next step's inputs
    graph.replay()
    assert out.tolist() == [10.0, 14.0] and refreshed == [1] and graph.replays == 1


def test_no_module_hook_runs_inside_a_replay_and_all_come_back_after():
    """Fails if `hooks_off` left a hook on inside the replay, or did not restore it after."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append("pre"))
    model[0].register_forward_hook(lambda *_: seen.append("post"))
    graphs.silence(model)
    graph = graphs.EmulatedGraph()
    graph.bind(lambda: model(torch.ones(1, 2)), ())
    graph.replay()
    assert seen == []
    model(torch.ones(1, 2))
    assert seen == ["pre", "post"]


def test_a_graph_binds_one_forward_and_replays_only_once_bound():
    graph = graphs.EmulatedGraph()
    with pytest.raises(RuntimeError, match="captured no forward"):
        graph.replay()
    graph.bind(lambda: None, ())
    with pytest.raises(RuntimeError, match="second forward"):
        graph.bind(lambda: None, ())


def test_the_graph_class_is_the_one_the_environment_names(monkeypatch):
    monkeypatch.delenv(graphs.GRAPH_ENV, raising=False)
    assert graphs.graph_class() is graphs.EmulatedGraph
    monkeypatch.setenv(graphs.GRAPH_ENV, "collections:OrderedDict")
    assert type(graphs.new_graph()).__name__ == "OrderedDict"
