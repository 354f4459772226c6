"""The recorder's compiled step path (`recording/_step_core.c`, `recording.steps`) against its
Python reference (`steps.PyStepCore`): built and loaded here (`make` builds it; a missing one
fails this tier), leaving the same audit log, journal, fields and errors over a script of steps
that takes every branch of `begin_step`, `forward_hook` and `end_step`; safe to collect; the
loader's reasons where it is not used."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.integrations.vllm.recording import forwards, steps
from runner_fsm.integrations.vllm.recording.journal import Journal, Later, read_journal
from runner_fsm.integrations.vllm.recording.recorder import ReplicaRecorder

TIMES = ("t_ns", "pid")  # what differs between two runs of the same script
FIELDS = ("step_id", "kind", "_batch", "_last_batch", "_last_values", "_decided_now", "_last_forward", "_forwards",
          "_gated")


def _python_recorder() -> type:
    """ReplicaRecorder over the Python reference instead of the compiled step path."""
    own = {k: v for k, v in vars(ReplicaRecorder).items() if k not in ("__dict__", "__weakref__")}
    return type("PyReplicaRecorder", (steps.PyStepCore,), own)


def _context(mode: str, tokens: int, dp: list[int] | None = None):
    return SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(_name_=mode),
                           batch_descriptor=SimpleNamespace(num_tokens=tokens, num_reqs=tokens, uniform=True),
                           dp_metadata=None if dp is None else SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(dp)))


class _Script:
    """One recorder driven through the script, everything it left noted as it went."""

    def __init__(self, cls: type, run_dir: Path):
        audit = AuditLog(run_dir, "core", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0))
        self.rec = cls(audit, Journal(str(run_dir), 0), fingerprints=False)
        self.run_dir, self.seen, self.ended = run_dir, [], []
        self.rec.after_end = lambda: self.ended.append(self.rec.step_id)

    def forward(self, mode: str, tokens: int, dp: list[int] | None = None, context: object = "made") -> None:
        forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=_context(mode, tokens, dp) if context == "made"
                                                 else context)
        try:
            self.call("forward_hook", None, (), {})
        finally:
            forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=None)

    def call(self, name: str, *args, **kwargs) -> None:
        """A method of the recorder; what it returned or raised and its fields after it, noted."""
        try:
            out = ("returned", getattr(self.rec, name)(*args, **kwargs))
        except TypeError as error:  # the interpreter's message and the compiled one's differ
            out = ("raised", TypeError)
        except (StepRefused, KeyError, AttributeError) as error:
            out = ("raised", type(error), str(error))
        entry = self.rec._entry
        entry = None if entry is None else {k: ("later", v.attr) if type(v) is Later else v for k, v in entry.items()}
        self.seen.append((name, out, entry, self.rec.machine.state, len(self.rec._pending),
                          [repr(getattr(self.rec, field)) for field in FIELDS]))

    def step(self, kind: str, scheduled: dict | None, mode: str = "NONE", tokens: int = 8, **end) -> None:
        entry = {"step": self.rec.step_id, "kind": kind, "spec": 0}
        self.call("begin_step", kind, None, scheduled, entry=entry) if scheduled else self.call("begin_step", kind)
        self.forward(mode, tokens, [tokens, 0])
        self.call("end_step", **end)


def _run(cls: type, run_dir: Path) -> tuple:
    s = _Script(cls, run_dir)
    rec = s.rec
    rec.start_capture()
    s.forward("FULL", 8)  # a capture: a graph record
    s.forward("NONE", 16)  # a warm-up forward: nothing
    rec.end_capture()
    s.step("prefill", {"a": 5, "b": 3}, sampled=[[1], [2]])
    s.step("decode", {"a": 1, "b": 1}, sampled=[[3], [4]])  # the batch changed
    for i in range(3):  # the same batch: the identity kept, the decisions unchanged (the compiled tail)
        s.step("decode", {"a": 1, "b": 1}, sampled=[[5 + i], [6]])
    s.call("begin_step", "decode", None, {"a": 1, "b": 1})  # no entry given: one made
    s.call("note", sampled=[[9], [9]])  # the tokens from the journal entry
    s.forward("NONE", 8)
    s.call("end_step")
    s.step("decode", {"b": 1, "a": 1}, mode="FULL", drafted=True, draft_steps=2, sampled=[[1], [1]])  # order: a new batch
    s.call("begin_step", "idle")
    s.forward("FULL", 8, [0, 8])  # an idle step's replay: dummy
    s.call("gate", 0)  # the gate said no draft: `finish` alone
    s.call("end_step", True, 2)
    s.call("begin_step", "decode", {"x": 1}, {"a": 2})  # fields merged into the entry
    s.call("note_later", "sampled", SimpleNamespace(tokens=[[1]]), "tokens")  # not known yet: no tokens digest
    s.forward("NONE", 8)
    s.call("end_step", drafted=False, draft_steps=0)
    s.call("begin_step", "decode", None, {"a": 1})
    s.call("begin_step", "decode", None, {"a": 1})  # refused mid-step: logged, raised, nothing changed
    s.call("end_step", False, 0, {"a": [4]})  # the embedded engine's form of sampled tokens
    s.call("begin_step", "decode", None, {"a": 1})
    s.forward("NONE", 0, context=None)  # no forward context (vLLM's eager forwards outside its runner)
    s.forward("NONE", 0, context=SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(_name_="PIECEWISE"),
                                                 batch_descriptor=None, dp_metadata=None))  # no descriptor
    s.call("end_step", sampled=[[1]])
    s.call("begin_step", "bogus")  # no such kind
    s.call("begin_step")  # no kind at all
    s.call("end_step", 1, 2, 3, 4)  # too many
    s.call("begin_step", "decode", None, {"a": 1}, what=1)  # no such argument
    lane_write, rec.machine.lane_write = rec.machine.lane_write, None  # no lane: the machine's method writes
    s.step("decode", {"a": 1}, sampled=[[2]])
    rec.machine.lane_write = lane_write
    for i in range(40):  # past the journal's batch: rendered on the way
        s.step("decode", {"a": 1, "c": 1}, sampled=[[i], [i]])
    s.call("begin_step", "idle")
    s.call("end_step")  # no forward at all
    rec.shutdown()
    log = [{k: v for k, v in r.items() if k not in TIMES} for r in read_records(next(run_dir.glob("rank-0*.jsonl")))]
    return log, read_journal(str(run_dir)), s.seen, s.ended


def test_the_compiled_step_path_is_built_and_loaded():
    """A checkout's `make` builds it, the package's build where a compiler is: here it runs."""
    assert steps.status() == {"compiled": True}
    assert steps.StepCore is not steps.PyStepCore and issubclass(ReplicaRecorder, steps.StepCore)
    assert ReplicaRecorder.begin_step is steps.StepCore.begin_step


def test_the_compiled_step_path_leaves_what_the_python_one_leaves(tmp_path, monkeypatch):
    """Every record, journal entry, field, return value and error, call by call. Mutations seen
    to fail this: listed in docs/vllm.md's sixth pass (each of `_step_core.c`'s branches)."""
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", SimpleNamespace(_forward_context=None))
    compiled = _run(ReplicaRecorder, tmp_path / "compiled")
    python = _run(_python_recorder(), tmp_path / "python")
    for name, got, want in zip(("log", "journal", "calls", "ended"), compiled, python):
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b, (name, i)
    log, journal, seen, ended = compiled
    # the script reached what it is for
    outcomes = [out[:2] for _, out, *_ in seen]
    assert outcomes.count(("raised", StepRefused)) == 1 and ("raised", KeyError) in outcomes
    assert outcomes.count(("raised", TypeError)) == 3
    finishes = [r for r in log if r.get("trigger") == "finish"]
    assert len(finishes) == len(ended) == 53 and ended == [r["step_id"] + 1 for r in finishes]
    assert [r["outcome"] for r in log if r.get("trigger") == "decode"].count("refused") == 1
    assert sum(1 for r in finishes if "decisions" not in r) >= 40  # the unchanged steps' tail
    assert [(r["step_id"], r["action"]) for r in log if r["event"] == "graph"] == [(-1, "capture"), (6, "replay"),
                                                                                   (7, "replay")]
    assert [r["step_id"] for r in log if r.get("trigger") == "draft"] == [6]
    assert journal[8]["x"] == 1 and journal[8]["kind"] == "decode" and journal[8]["sampled"] == [[1]]
    assert [entry["step"] for entry in journal] == list(range(53))  # each entry once, a refused step's too


def test_a_hook_outside_steps_keeps_only_graph_captures(tmp_path, monkeypatch):
    rec = ReplicaRecorder(AuditLog(tmp_path, "core", 0, 0, 0), None, fingerprints=False)
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", SimpleNamespace(_forward_context=_context("NONE", 4)))
    assert rec.forward_hook(None, (), {}) is None and rec._forwards == [] and rec._last_forward == steps.NO_FORWARD
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", SimpleNamespace(_forward_context=_context("FULL", 4)))
    rec.forward_hook(None, (), {})
    assert rec._forwards == [(None, (), False, "FULL", (4, 4, True), False)]
    with pytest.raises(TypeError):
        rec.forward_hook(None, ())  # torch hands three


def test_a_recorder_without_its_fields_raises_and_its_machine_is_a_machine(tmp_path):
    """A StepCore that `__init__` never set up raises, it does not crash the process."""
    bare = ReplicaRecorder.__new__(ReplicaRecorder)
    with pytest.raises(AttributeError, match="machine"):
        bare.begin_step("decode")
    with pytest.raises(AttributeError):
        bare.machine
    rec = ReplicaRecorder(AuditLog(tmp_path, "core", 0, 0, 0), None)
    with pytest.raises(TypeError, match="MachineCore"):
        rec.machine = object()


class _Peer:
    def __init__(self, rec: ReplicaRecorder):
        self.rec = rec

    def after_step(self) -> None:
        pass


def test_a_recorder_in_a_reference_cycle_is_collected(tmp_path):
    """`after_end` is a peer's bound method that holds the recorder (`replica_check`): the
    cycle goes through the compiled fields, which the collector must see."""
    rec = ReplicaRecorder(AuditLog(tmp_path, "core", 0, 0, 0), None)
    rec.after_end = _Peer(rec).after_step
    gone = weakref.ref(rec)
    rec.audit.close()
    del rec
    gc.collect()
    assert gone() is None


def _load_from(tmp_path, monkeypatch, text: bytes | None = None):
    """`steps.load` pointed at a copy of the source in tmp_path."""
    source = tmp_path / "_step_core.c"
    source.write_bytes(steps.SOURCE.read_bytes() if text is None else text)
    monkeypatch.setattr(steps, "SOURCE", source)
    monkeypatch.setattr(steps, "BUILD_ERROR", tmp_path / "_step_core.build-error")
    return steps.load()


def test_the_loader_says_why_the_compiled_path_is_not_used(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNNER_FSM_NATIVE", raising=False)
    module, why_not = _load_from(tmp_path, monkeypatch)
    assert module is not None and why_not is None
    module, why_not = _load_from(tmp_path, monkeypatch, steps.SOURCE.read_bytes() + b"/* changed */\n")
    assert module is None and "was built from other source" in why_not and "rebuild it" in why_not
    monkeypatch.setattr(steps, "MODULE", "runner_fsm.integrations.vllm.recording._no_such_core")
    module, why_not = _load_from(tmp_path, monkeypatch)
    assert module is None and "is not built" in why_not
    (tmp_path / "_step_core.build-error").write_text("building it failed: no compiler")
    assert "no compiler" in steps.load()[1]
    monkeypatch.setenv("RUNNER_FSM_NATIVE", "0")
    assert steps.load() == (None, "turned off by RUNNER_FSM_NATIVE=0")
