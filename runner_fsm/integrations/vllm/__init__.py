"""Drop-in worker for vLLM's engine core: `--worker-cls runner_fsm.integrations.vllm.FSMWorker`.

`FSMWorker` is imported lazily, so the vLLM-free parts of this package (request translation,
options, errors) import without vLLM installed.
"""

from __future__ import annotations

__all__ = ["FSMWorker"]


def __getattr__(name: str):
    if name == "FSMWorker":
        from runner_fsm.integrations.vllm.worker import FSMWorker

        return FSMWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
