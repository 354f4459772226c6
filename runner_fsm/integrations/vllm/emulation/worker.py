"""`EmulatedDeviceWorker`: vLLM's CPU worker, doing at start-up what vLLM's CUDA worker does.

vLLM 0.32's CUDA worker (`v1/worker/gpu_worker.py`) makes the workspace manager in
`init_device`, and in `compile_or_warm_up_model` runs Model Runner V2's JIT warm-up,
`warmup_kernels(runner, self.execute_model, self.sample_tokens)` (whole steps through the
*worker's* own `execute_model`: FSMWorker's, where it wraps this class), then captures the
graphs (`capture_model()`). The CPU worker does neither; this class does both, in that order,
then the CPU worker's own end (its seed reset).

Under Triton's interpreter (MRV2 on this CPU, tests only) two of the warm-up's kernels cannot
run: the grammar bitmask ("mask has unsupported dtype") and top-k/top-p sampling. There the
warm-up's sampling parameters leave top-k/top-p out and its bitmask is not applied; every other
part of the warm-up runs as on a device. Said in the job record (`describe`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from runner_fsm.integrations.vllm.emulation import graphs


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class EmulatedDeviceWorker(CPUWorker):
    """The CPU worker with the CUDA worker's warm-up and capture (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.emulation = graphs.install()  # in this process: the worker's (spawned under DP or TP)
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(torch.device("cpu"))  # as the CUDA worker does, before its runner
        super().init_device()

    def compile_or_warm_up_model(self):
        runner = self.model_runner
        if self.use_v2_model_runner and self.vllm_config.kernel_config.enable_jit_warmup:
            from vllm.v1.worker.gpu.warmup import warmup_kernels

            with _interpreter_warmup(self.sample_tokens) as sample_tokens:
                warmup_kernels(runner, self.execute_model, sample_tokens)
        if not self.model_config.enforce_eager and self.use_v2_model_runner:
            graphs.silence(runner.model)  # no worker hook runs inside a replay, as on a device
            runner.capture_model()
        return super().compile_or_warm_up_model()

    def describe_emulation(self) -> dict:
        """The job record's account of the emulation in this process."""
        config = self.vllm_config
        return {**self.emulation, "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
                "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
                "jit_warmup": bool(config.kernel_config.enable_jit_warmup),
                "async_scheduling": bool(config.scheduler_config.async_scheduling),
                "executor": str(config.parallel_config.distributed_executor_backend),
                "graphs_emulated_on": "mrv2" if self.use_v2_model_runner else "none (V1 runs eager here)",
                "interpreter_warmup": "no top-k/top-p, no grammar bitmask" if interpreted() else "as on a device",
                "not_reproduced": "host code frozen by a real capture beyond the CPU attention split,"
                                  " graph pool reuse, device speed"}


@contextlib.contextmanager
def _interpreter_warmup(sample_tokens: Any) -> Iterator[Any]:
    """Under Triton's interpreter: the warm-up's sampler parameters without top-k/top-p (a
    static method of vLLM's `SamplingParams`, replaced for the warm-up only and put back), and
    `sample_tokens` without the grammar bitmask. Elsewhere `sample_tokens` as it is."""
    if not interpreted():
        yield sample_tokens
        return
    from vllm import SamplingParams

    original = SamplingParams.__dict__["for_sampler_warmup"]

    def for_sampler_warmup() -> SamplingParams:
        params = original.__func__()
        params.top_p, params.top_k = 1.0, 0
        return params

    SamplingParams.for_sampler_warmup = staticmethod(for_sampler_warmup)
    try:
        yield lambda _grammar_output: sample_tokens(None)
    finally:
        SamplingParams.for_sampler_warmup = original
