"""The recorder's own forward hook (`ReplicaRecorder.forward_hook`, registered at
`audit=transitions` on a single PCP rank) writes what the worker's general hook
(`FSMWorkerMixin._before_forward`) writes there: the same records and the same journal, over
graph captures, real steps, idle steps, graph replays, eager forwards and DP token counts.

Both run over the stand-in of vLLM's worker that `benchmarks/step_calls.py` counts with."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_calls import scheduler_output, stand_in_worker  # noqa: E402

from runner_fsm.audit import read_records  # noqa: E402
from runner_fsm.integrations.vllm.recording import forwards  # noqa: E402
from runner_fsm.integrations.vllm.recording.journal import read_journal  # noqa: E402

TIMES = ("t_ns", "pid")  # what differs between two runs of the same script


def _context(mode: str, tokens: int, dp: list[int] | None = None):
    return SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(_name_=mode),
                           batch_descriptor=SimpleNamespace(num_tokens=tokens, num_reqs=tokens, uniform=True),
                           dp_metadata=None if dp is None else SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(dp)))


# (what runs, graph mode, padded tokens, DP token counts): a capture's forwards first
SCRIPT = [("capture", "FULL", 8, None), ("capture", "NONE", 16, None), ("capture", "FULL", 16, None),
          ("real", "NONE", 16, [16, 0]), ("real", "FULL", 16, [16, 16]), ("idle", "FULL", 8, [0, 16]),
          ("idle", "NONE", 1, [0, 3]), ("real", "FULL", 8, None), ("real", "FULL", 8, None), ("idle", "NONE", 1, None)]


def _run(run_dir: Path, lean: bool) -> tuple[list[dict], list[dict]]:
    worker = stand_in_worker(str(run_dir), captured=False)
    assert worker.hook == worker.recorder.forward_hook  # transitions, one PCP rank: the recorder's own
    if not lean:
        worker.hook = worker._before_forward
    captured = False
    for step, (what, mode, tokens, dp) in enumerate(SCRIPT):
        worker.context = _context(mode, tokens, dp)
        if what == "capture":
            worker.forward()
            continue
        if not captured:
            worker.recorder.end_capture()
            captured = True
        if what == "idle":
            worker.execute_dummy_batch()
        else:
            worker.execute_model(scheduler_output(step))
            worker.sample_tokens(None)
    worker.recorder.shutdown()
    log = [{k: v for k, v in r.items() if k not in TIMES} for r in read_records(next(run_dir.glob("rank-0*.jsonl")))]
    return log, read_journal(str(run_dir))


def test_the_recorders_hook_writes_what_the_workers_hook_writes(tmp_path, monkeypatch):
    """Mutations seen to fail this: the recorder's hook taking an idle step's forward as real;
    skipping graph captures; the DP token counts left out; the forward's graph mode and size not
    kept for the step's decisions (in both hooks: the general hook's `on_forward` too)."""
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", None)  # the stand-in sets its own
    lean = _run(tmp_path / "lean", lean=True)
    general = _run(tmp_path / "general", lean=False)
    assert lean == general
    log, journal = lean
    graphs = [(r["step_id"], r["action"]) for r in log if r["event"] == "graph"]
    assert graphs == [(-1, "capture"), (-1, "capture"), (1, "replay"), (2, "replay"), (4, "replay"), (5, "replay")]
    assert [e["forwards"][0][0] for e in journal] == ["real", "real", "dummy", "dummy", "real", "real", "dummy"]
    assert journal[0]["forwards"] == [["real", "NONE", [16, 16, True], [16, 0]]]
    decided = [(r["step_id"], r.get("decisions")) for r in log if r.get("trigger") == "finish"]
    assert decided[1:4] == [(1, {"graph": 16}), (2, {"real": 0, "batch": 0, "dispatch": 0, "padded": 8, "graph": 8}),
                            (3, {"padded": 1, "graph": 0})]


def test_the_worker_keeps_its_own_hook_where_it_fingerprints_or_reads_pcp_evidence(tmp_path, monkeypatch):
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", None)
    worker = stand_in_worker(str(tmp_path / "a"))
    assert worker.forward_hook() == worker.recorder.forward_hook
    worker.place = SimpleNamespace(sizes=SimpleNamespace(pcp=2))
    assert worker.forward_hook() == worker._before_forward
    worker.place = SimpleNamespace(sizes=SimpleNamespace(pcp=1))
    worker.recorder.fingerprints = True
    assert worker.forward_hook() == worker._before_forward
    worker.recorder.shutdown()


@pytest.mark.parametrize("pcp", [None, object()])
def test_a_runner_with_pcp_evidence_under_the_lean_hook_is_refused(tmp_path, monkeypatch, pcp):
    """The lean hook reads no PCP evidence: a runner that built some with one PCP rank stops
    the worker before warm-up instead of leaving it unread."""
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", None)
    worker = stand_in_worker(str(tmp_path / "b"))
    worker.forward_hook()
    worker.runner_adapter = SimpleNamespace(pcp=pcp, name="v1", attach_kv=lambda: None)
    if pcp is None:
        worker.check_lean_hook()
    else:
        with pytest.raises(RuntimeError, match="v1 runner built PCP evidence with prefill_context_parallel_size 1"):
            worker.check_lean_hook()
    worker.recorder.shutdown()


@pytest.mark.parametrize("adapter_cls", ["V1Runner", "MRV2Runner"])
@pytest.mark.parametrize("inputs", [True, False])
def test_the_runners_input_preparations_are_wrapped_only_where_read(adapter_cls, inputs):
    """`attach(inputs=False)` (the recorder's hook, no DP support, no peers' check) leaves the
    runner's input preparations as vLLM made them: two Python calls less a step inside vLLM's."""
    from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner
    from runner_fsm.integrations.vllm.runners.v1 import V1Runner

    cls = {"V1Runner": V1Runner, "MRV2Runner": MRV2Runner}[adapter_cls]
    names = ("_prepare_inputs", "_dummy_run") if cls is V1Runner else ("prepare_attn", "prepare_dummy_attn")

    class Runner:
        pass

    runner = Runner()
    originals = {name: (lambda *a, **k: ("out", "slots")) for name in names}
    for name, fn in originals.items():
        setattr(runner, name, fn)
    adapter = cls(runner)
    adapter.attach(step_of=lambda: 0, inputs=inputs)
    assert all((getattr(runner, name) is fn) is not inputs for name, fn in originals.items())
    if cls is MRV2Runner:  # its step counter is kept either way (its DP roles read it)
        assert adapter._step_of() == 0
