"""Errors of the vLLM integration; they extend the runner's one hierarchy."""

from __future__ import annotations

from runner_fsm.errors import ConfigError
from runner_fsm.states.machine import TransitionRefused


class VLLMSchemaError(ConfigError):
    """The installed vLLM lacks a name the worker relies on (raised at start-up)."""


class UnsupportedFeatureError(ConfigError):
    """A vLLM configuration FSMWorker cannot record faithfully (raised at start-up)."""


class StepRefused(TransitionRefused):
    """vLLM asked for a step the replica's transition table does not allow now."""
