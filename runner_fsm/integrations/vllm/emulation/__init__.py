"""An emulation of the device configuration on vLLM's CPU platform (DESIGN section 12), opt-in.

vLLM's CPU platform turns off what CUDA and Ascend users run by default: captured FULL graphs,
the JIT warm-up through the worker and async scheduling. With `RUNNER_FSM_EMULATE_DEVICE=1`
(read by the `vllm.platform_plugins` entry point `plugin.platform`, in every process vLLM
starts) vLLM runs on `platform.EmulatedDevicePlatform`: the CPU platform with those put back,
and `worker.EmulatedDeviceWorker`, the CPU worker calling what the CUDA worker calls. A FULL
graph is `graphs.EmulatedGraph`: the forward built for a descriptor, bound at capture to the
buffers it read; its replay reruns that forward over the same buffers with every module hook
off, as a device replays a graph without running Python. What the CPU attention backend
computes on the host at build time is refreshed before each replay (`cpu_attention`).

It is an emulation and says so: the job record names it. It does not reproduce the host code a
real capture freezes (beyond what is refreshed), the graph memory pool's reuse, or a device's
speed. Nothing here is imported unless the variable is set; FSMWorker itself never needs it:
its graph records come from vLLM's graph manager, the same calls on a device.
"""

from __future__ import annotations

import os

ENV = "RUNNER_FSM_EMULATE_DEVICE"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")
