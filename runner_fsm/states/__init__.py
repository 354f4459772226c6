"""Replica states and the transition table (data)."""

from runner_fsm.states.table import (LIVE_STATES, STEP_STATES, TRANSITIONS, State, Transition, Trigger, is_legal,
                                     mermaid, next_state)

__all__ = [
    "LIVE_STATES", "STEP_STATES", "TRANSITIONS", "State", "Transition", "Trigger",
    "is_legal", "mermaid", "next_state",
]
