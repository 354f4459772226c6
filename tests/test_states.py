"""The transition table: legality, and the generated Mermaid diagram in docs/states.md."""

from pathlib import Path

import pytest

from runner_fsm.cli import main
from runner_fsm.states import TRANSITIONS, State, Trigger, is_legal, mermaid, next_state

DOC = Path(__file__).resolve().parents[1] / "docs" / "states.md"


def test_docs_diagram_matches_table():
    text = DOC.read_text()
    assert mermaid() in text, "docs/states.md is stale: regenerate it with `runner-fsm states`"


def test_cli_prints_the_diagram(capsys):
    assert main(["states"]) == 0
    assert capsys.readouterr().out == mermaid()


def test_every_step_goes_through_ready():
    for trig in (Trigger.PREFILL, Trigger.DECODE, Trigger.IDLE):
        step_state = next_state(State.READY, trig)
        assert next_state(step_state, Trigger.FINISH) is State.READY
        assert next_state(step_state, Trigger.DRAFT) is State.DRAFT_SYNC
    assert next_state(State.DRAFT_SYNC, Trigger.FINISH) is State.READY


@pytest.mark.parametrize("src, trig", [
    (State.INIT, Trigger.PREFILL), (State.READY, Trigger.DRAFT), (State.DRAFT_SYNC, Trigger.DRAFT),
    (State.PREFILL, Trigger.DECODE), (State.STOPPED, Trigger.FAULT), (State.FAULTED, Trigger.IDLE),
    (State.PREFILL, Trigger.SHUTDOWN),
])
def test_illegal_edges(src, trig):
    assert next_state(src, trig) is None
    assert not is_legal(src, trig, State.READY)


def test_is_legal_accepts_strings_and_unknown_names():
    assert is_legal("ready", "prefill", "prefill")
    assert not is_legal("ready", "prefill", "decode")
    assert next_state("ready", "warp") is None


def test_every_live_state_can_fault():
    for state in State:
        expected = None if state in (State.FAULTED, State.STOPPED) else State.FAULTED
        assert next_state(state, Trigger.FAULT) is expected


def test_table_has_no_duplicate_edges():
    edges = [(s, t.trigger) for t in TRANSITIONS for s in t.sources]
    assert len(edges) == len(set(edges))
