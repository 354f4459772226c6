"""The worker vLLM would have used on this platform: the class FSMWorker wraps.

The same choice vLLM's platforms make for `worker_cls="auto"` (`check_and_update_config`):
CPU `vllm.v1.worker.cpu_worker.CPUWorker`, CUDA/ROCm `vllm.v1.worker.gpu_worker.Worker`,
Ascend NPU vllm-ascend's `NPUWorker` (imported only there, never installed elsewhere). A
platform that names its own `auto_worker_cls` (the device emulation's, `emulation/platform.py`)
is taken at its word.
"""

from __future__ import annotations

import importlib

from runner_fsm.integrations.vllm.common.errors import UnsupportedFeatureError

WORKERS = {
    "cpu": ("vllm.v1.worker.cpu_worker.CPUWorker",),
    "cuda": ("vllm.v1.worker.gpu_worker.Worker",),
    # vllm-ascend moved its worker between releases; the first that imports is the one.
    "npu": ("vllm_ascend.worker.worker.NPUWorker", "vllm_ascend.worker.worker_v1.NPUWorker"),
}


def platform_device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def platform_worker_path(device_type: str) -> str:
    """The qualified name of the platform worker that imports here."""
    candidates = WORKERS.get(device_type)
    if candidates is None:
        raise UnsupportedFeatureError(f"FSMWorker knows the workers of {sorted(WORKERS)}, not of"
                                      f" device type {device_type!r}")
    errors = []
    for path in candidates:
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
            return path
        except (ImportError, AttributeError) as err:
            errors.append(f"{path}: {err}")
    raise UnsupportedFeatureError(f"no worker for {device_type!r} imports: " + "; ".join(errors))


def platform_worker_cls() -> type:
    from vllm.platforms import current_platform

    path = getattr(current_platform, "auto_worker_cls", None) or platform_worker_path(platform_device_type())
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
