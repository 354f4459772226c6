"""Drop-in worker for vLLM: `--worker-cls runner_fsm.integrations.vllm.FSMWorker`.

`FSMWorker` is made on first access: the platform's own worker (CPU, CUDA, Ascend NPU) with
the replica state machine mixed in (`worker.FSMWorkerMixin`). The vLLM-free parts of this
package (options, errors) import without vLLM installed.
"""

from __future__ import annotations

__all__ = ["FSMWorker"]


def __getattr__(name: str):
    if name == "FSMWorker":
        from runner_fsm.integrations.vllm.worker import make_worker_class

        cls = globals()["FSMWorker"] = make_worker_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
