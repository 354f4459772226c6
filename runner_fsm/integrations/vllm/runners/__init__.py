"""Runner adapters: one per vLLM model runner, chosen from the live runner's class (base.py)."""

from __future__ import annotations

from typing import Any

from runner_fsm.integrations.vllm.common.errors import UnsupportedFeatureError
from runner_fsm.integrations.vllm.runners.ascend import AscendMRV2Runner
from runner_fsm.integrations.vllm.runners.base import (NAMES, REQUEST_BUFFERS, TOKEN_BUFFERS, ForwardInputs,
                                                       RunnerAdapter)
from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner
from runner_fsm.integrations.vllm.runners.v1 import V1Runner

# Most specific first: vLLM-Ascend's runner is an MRV2 runner too.
ADAPTERS: tuple[type[RunnerAdapter], ...] = (AscendMRV2Runner, MRV2Runner, V1Runner)

__all__ = ["ADAPTERS", "NAMES", "REQUEST_BUFFERS", "TOKEN_BUFFERS", "ForwardInputs", "RunnerAdapter",
           "adapter_for"]


def adapter_for(runner: Any) -> RunnerAdapter:
    """The adapter of `runner`'s class; `UnsupportedFeatureError` naming the class otherwise."""
    for adapter in ADAPTERS:
        if adapter.serves(type(runner)):
            return adapter(runner)
    cls = type(runner)
    known = sorted({name for a in ADAPTERS for name in a.CLASSES})
    raise UnsupportedFeatureError(f"FSMWorker has no adapter for the model runner {cls.__module__}."
                                  f"{cls.__qualname__}; it knows runners derived from {known}")
