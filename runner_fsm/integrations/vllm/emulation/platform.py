"""`EmulatedDevicePlatform`: vLLM's CPU platform with the device configuration put back.

What `CpuPlatform.check_and_update_config` turns off, and what this class gives back (vLLM
0.32; `vllm-0.32-hooks.md`, "What the CPU platform turns off"):

| vLLM's CPU platform                                  | here                                               |
|------------------------------------------------------|----------------------------------------------------|
| no static graphs (`support_static_graph_mode`)       | static graphs: vLLM sizes its capture list         |
| `cudagraph_capture_sizes = []`                       | vLLM's sizes kept; `cudagraph_mode` FULL_DECODE_ONLY|
| `async_scheduling = False`                           | what vLLM resolved before the platform hook         |
| compilation `DYNAMO_TRACE_ONCE` (inductor)           | `NONE`: FULL graphs need no compiler (2 CPU cores)  |
| `worker_cls="auto"`: `CPUWorker`                     | `EmulatedDeviceWorker` (warm-up and capture)        |
| no graph pool                                        | a token pool (`graph_pool_handle`)                  |

PIECEWISE graphs need torch.compile; they are not emulated. Graphs are emulated for Model
Runner V2 (vLLM's default where Triton works, the CUDA default); the V1 runner's graphs
(`CUDAGraphWrapper`, which keeps weak references to its outputs) are not: under V1 the
emulation runs eager, with async scheduling. `enforce_eager=True` keeps its meaning (no graphs,
no JIT warm-up), as on a device.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

WORKER = "runner_fsm.integrations.vllm.emulation.worker.EmulatedDeviceWorker"
EMULATED_POOL = ("runner-fsm-emulated-graph-pool", 0)  # vLLM only hands the pool back to the capture


class EmulatedDevicePlatform(CpuPlatform):
    """The CPU platform, in the device configuration (see the module docstring)."""

    emulated_device = True  # read by `platform_worker` and the job record
    auto_worker_cls = WORKER  # the worker FSMWorker wraps here

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def graph_pool_handle(cls):
        return EMULATED_POOL

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
        parallel = vllm_config.parallel_config
        sizes, async_scheduling = list(compilation.cudagraph_capture_sizes or []), scheduler.async_scheduling
        auto_worker = parallel.worker_cls == "auto"
        super().check_and_update_config(vllm_config)
        scheduler.async_scheduling = async_scheduling  # vLLM resolved it before this hook (config/vllm.py)
        if auto_worker:
            parallel.worker_cls = WORKER
        compilation.mode = CompilationMode.NONE
        if not vllm_config.use_v2_model_runner:  # V1's graph wrapper is not emulated (above)
            compilation.cudagraph_mode = CUDAGraphMode.NONE
        elif compilation.cudagraph_mode != CUDAGraphMode.NONE and sizes:
            compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            compilation.cudagraph_capture_sizes = sizes
            compilation.max_cudagraph_capture_size = max(sizes)
