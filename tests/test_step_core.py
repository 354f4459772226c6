"""The recorder's compiled step path (`recording/_step_core.c`, `recording.steps`) against its
Python reference (`steps.PyStepCore`): built and loaded here (`make` builds it; a missing one
fails this tier), leaving the same audit log, journal, fields and errors over a script of steps
that takes every branch of `begin_step`, `forward_hook` and `end_step`; safe to collect; the
loader's reasons where it is not used."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
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


# -- Python code that runs inside the step path: a request id's, a descriptor's, a state's or a
# journal's own methods may set the recorder's fields while the compiled path is using them.
# Each case runs on both paths: the same outcome and fields, and no crash (each one crashed the
# compiled path once, reading a field it no longer held).

def _fresh(cls: type, run_dir: Path) -> ReplicaRecorder:
    rec = cls(AuditLog(run_dir, "core", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)), Journal(str(run_dir), 0),
              fingerprints=False)
    rec.start_capture()
    rec.end_capture()
    return rec


def _key_resetting(rec, field: str, value):
    class Key:  # equal to any key it meets, setting the recorder's field as it compares
        def __hash__(self):
            return hash("forwards")

        def __eq__(self, other):
            setattr(rec, field, value)
            return True
    return Key()


def _batch_compared(rec):
    rec._last_batch = ([_key_resetting(rec, "_last_batch", ([], [], (0, 0)))], [1], (object(), 1))
    return rec.begin_step("prefill", None, {_key_resetting(rec, "_last_batch", None): 1})


def _descriptor_read(rec):
    rec.begin_step("decode")

    class Descriptor:
        def __bool__(self):
            rec._last_forward, rec._batch = ("NONE", None), (0, 0)
            return True

        def __getitem__(self, i):
            return 4
    rec._last_forward, rec._batch = ("FULL", Descriptor()), (object(), 1)
    return rec.end_step()


def _gate_compared(rec):
    rec.begin_step("decode")

    class Gate(int):
        def __gt__(self, other):
            rec._gated = None
            return "yes"  # `gated > 0` as it is: handed to `_end_with_records`
    rec._gated = Gate(2)
    return rec.end_step()


def _journal_appended(rec):
    class Pending(list):
        def append(self, entry):
            super().append(entry)
            rec._pending, rec._entry = None, None  # this journal freed, as the path still reads it
    rec._pending, rec._entry = Pending(), {"step": 0}
    return rec.begin_step("prefill")


def _entry_looked_up(rec):
    rec.begin_step("decode")
    rec._entry = {_key_resetting(rec, "_entry", None): 1, "step": 0}
    forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=_context("FULL", 8))
    return rec.forward_hook(None, (), {})


def _state_compared(rec):
    from runner_fsm.states import State, Trigger
    machine = rec.machine
    start = machine.now

    class Now:  # equal to the move's state, replacing itself as it compares
        def __hash__(self):
            return hash(start)

        def __eq__(self, other):
            machine.now = start
            return True
    machine.moves = {**machine.moves, (Now(), Trigger.PREFILL): (State.PREFILL, b"{}")}
    machine.now = Now()
    return rec.begin_step("prefill")


def _odd_containers(rec):
    import collections
    rec._last_batch = [[], [], (0, 0)]  # unpacked, whatever holds the three
    rec.begin_step("idle", None, {"a": 1})
    rec._forwards = collections.deque()
    forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=_context("FULL", 8))
    rec.forward_hook(None, (), {})
    rec._last_forward = ("FULL", {0: 8})  # `desc[0]`: an item of a mapping too
    return rec.end_step(), list(rec._forwards)


def _str_subclass_kind(rec):
    class Kind(str):
        pass
    rec.begin_step(Kind("idle"), entry=__import__("collections").OrderedDict(step=0))
    forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=_context("FULL", 8))
    rec.forward_hook(None, (), {})
    return rec._forwards, dict(rec._entry)


def _bad_arguments(rec):
    out = []
    for call in (lambda: rec.begin_step(("a", "b")), lambda: rec.begin_step("decode", [("x", 1)])):
        try:
            call()
        except (KeyError, TypeError) as error:
            out.append((type(error), error.args))
    return out


def _step_id_moved_by_records(rec):
    rec.begin_step("decode")
    rec._end_with_records = lambda step, drafted, tail: setattr(rec, "step_id", 100)
    rec.end_step(drafted=True, draft_steps=1)
    return rec.step_id  # `step + 1`, as the Python path sets it


INSIDE = [_batch_compared, _descriptor_read, _gate_compared, _journal_appended, _entry_looked_up, _state_compared,
          _odd_containers, _str_subclass_kind, _bad_arguments, _step_id_moved_by_records]


def _observe(cls: type, run_dir: Path, case) -> tuple:
    rec = _fresh(cls, run_dir)
    drafted = []
    if case is _gate_compared:
        rec._end_with_records = lambda step, d, tail: drafted.append(d)
    try:
        out = ("returned", repr(case(rec)))
    except Exception as error:
        out = ("raised", type(error), str(error))
    finally:
        forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=None)
    [object() for _ in range(10_000)]  # reuse what a dangling read would have freed
    gc.collect()
    fields = [repr(getattr(rec, field, "unset")) for field in FIELDS + ("_entry", "_pending")]
    return out, fields, rec.machine.state, drafted


@pytest.mark.parametrize("case", INSIDE, ids=[case.__name__.strip("_") for case in INSIDE])
def test_python_code_inside_the_step_path_sees_what_the_python_one_sees(tmp_path, monkeypatch, case):
    """Seen to fail on the build before the review (68ca42a's `_step_core.c`): the fields read
    borrowed (batch, descriptor, gate, state: crashes), `self->step_id += 1` (step id moved by
    records), `PyUnicode_CheckExact` alone in `is_str` (str subclass kind), `PyList_Append` on
    any container (odd containers), `PyErr_SetObject(KeyError, kind)` (bad arguments)."""
    monkeypatch.setattr(forwards, "_VLLM_CONTEXT", SimpleNamespace(_forward_context=None))
    compiled = _observe(ReplicaRecorder, tmp_path / "compiled", case)
    python = _observe(_python_recorder(), tmp_path / "python", case)
    clean = re.compile(r" at 0x[0-9a-f]+|Py")  # addresses and the reference class's name
    assert clean.sub("", repr(compiled)) == clean.sub("", repr(python))
    if case is _gate_compared:
        assert compiled[3] == ["yes"]
    if case is _step_id_moved_by_records:
        assert compiled[0] == ("returned", "1")
    if case is _bad_arguments:
        assert compiled[0] == ("returned", repr([(KeyError, (("a", "b"),)),
                                                 (TypeError, ("'list' object is not a mapping",))]))


def test_an_unconfigured_step_path_raises(tmp_path):
    """The compiled module imported on its own (not through `steps.load`) refuses to step.
    Seen to fail without the `CONFIGURED` check (the build before the review: no refusal)."""
    code = ("import importlib, sys\n"
            "m = importlib.import_module('runner_fsm.integrations.vllm.recording._step_core')\n"
            "core = m.StepCore()\n"
            "for call in (lambda: core.begin_step('decode'), lambda: core.forward_hook(1, 2, 3), core.end_step):\n"
            "    try:\n        call()\n    except RuntimeError as e:\n        print('refused:', e)\n")
    env = {**os.environ, "RUNNER_FSM_NATIVE": "0"}  # steps.load does not configure it
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused: the compiled step path is not configured") == 3
