"""Errors of the vLLM integration; they extend the runner's one hierarchy."""

from __future__ import annotations

from runner_fsm.errors import BatchError, ConfigError


class VLLMSchemaError(ConfigError):
    """The installed vLLM lacks a field or method the worker relies on (raised at start-up)."""


class UnsupportedFeatureError(ConfigError):
    """A vLLM feature or configuration FSMWorker does not implement (raised at start-up)."""


class UnsupportedRequestError(BatchError):
    """A request whose sampling needs something other than greedy decoding of token ids."""


class RequestStateError(BatchError):
    """vLLM's scheduler and the worker disagree about a request (tokens, blocks, ids)."""
