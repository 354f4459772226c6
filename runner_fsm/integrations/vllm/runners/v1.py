"""vLLM's V1 model runner (`vllm/v1/worker/gpu_model_runner.py`; the CPU runner subclasses it).

Its persistent inputs are attributes of the runner (`input_ids`, `positions`, `query_start_loc`,
`seq_lens`: CpuGpuBuffers whose `.gpu` aliases `.cpu` on the CPU) and of its input batch (block
table and slot mapping of KV group 0). Its DP sync is `vllm.v1.worker.dp_utils._run_ar`, reached
through `_determine_batch_execution_and_padding` (the runner's: TARGET; the drafter's: draft
phases), see `v1_dp`. The idle replica's forward is `_dummy_run`; the drafter's DP syncs
on an idle replica come from `drafter.dummy_run`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from runner_fsm.integrations.vllm.runners import v1_dp
from runner_fsm.integrations.vllm.runners.base import (ForwardInputs, RunnerAdapter, SkipDummyForward, new_inputs,
                                                       skipping_dummy, wrap_method)


def _tensor(buf: Any) -> torch.Tensor:
    """A CpuGpuBuffer's device tensor (on the CPU it aliases `.cpu`), or the tensor itself."""
    return buf if isinstance(buf, torch.Tensor) else buf.gpu


class V1Runner(RunnerAdapter):
    name = "v1"
    CLASSES = ("vllm.v1.worker.gpu_model_runner.GPUModelRunner",)
    ATTRS = ("model", "input_ids", "positions", "query_start_loc", "seq_lens", "max_num_reqs",
             "input_batch.num_reqs", "input_batch.block_table[0].block_table",
             "input_batch.block_table[0].slot_mapping", "parallel_config",
             "_determine_batch_execution_and_padding", "_dummy_run", "_prepare_inputs", "intermediate_tensors",
             "max_num_tokens", "model_config", "device")
    READS = {"runner": ("drafter",), "drafter": ("_determine_batch_execution_and_padding", "dummy_run")}
    DP_ROWS = len(v1_dp.VLLM_ROWS)

    def buffers(self) -> dict[str, torch.Tensor]:
        runner = self.runner
        table = runner.input_batch.block_table[0]
        return {"input_ids": _tensor(runner.input_ids), "positions": _tensor(runner.positions),
                "slot_mapping": _tensor(table.slot_mapping), "query_start_loc": _tensor(runner.query_start_loc),
                "seq_lens": _tensor(runner.seq_lens), "block_table": _tensor(table.block_table)}

    def attach(self, step_of: Callable[[], int] | None = None, inputs: bool = True) -> None:
        """V1 writes a real batch's inputs in `_prepare_inputs`, a dummy's in `_dummy_run`
        (counted for the probe's staleness stamps, read only by the full audit)."""
        if not inputs:
            return
        for name in ("_prepare_inputs", "_dummy_run"):
            wrap_method(self.runner, name, self._writing)

    def _writing(self, method, args, kwargs):
        self.inputs_written()
        return method(*args, **kwargs)

    def forward_inputs(self, args: dict, *, dummy: bool, capturing: bool) -> ForwardInputs:
        ids = args.get("input_ids")
        if isinstance(ids, torch.Tensor):
            num_tokens = ids.numel()  # 1-d (the flat batch): cheaper than `.shape` (a torch.Size)
        else:  # embeddings in: the positions ((3, tokens) under M-RoPE)
            ref = args.get("positions")
            num_tokens = int(ref.shape[-1]) if isinstance(ref, torch.Tensor) else 0
        runner = self.runner
        # A dummy (or capture) batch of n tokens has min(n, max_num_reqs) requests in vLLM's _dummy_run.
        num_reqs = min(num_tokens, runner.max_num_reqs) if dummy or capturing else int(runner.input_batch.num_reqs)
        return new_inputs(ForwardInputs, (runner.input_batch, self.buffers, num_tokens, num_reqs, self.writes))

    def install_dp(self, tap) -> Callable[[], None]:
        return v1_dp.install(tap, self.runner)

    def dp_group(self) -> tuple[Any, Any]:
        return v1_dp.dp_group(self.runner.parallel_config)

    def lacks_pp_buffers(self, vllm_config: Any) -> bool:
        """A later pipeline stage of vLLM's CPU runner in eager mode: vLLM allocates the
        intermediate tensors such a stage receives only in `_dummy_run`, which the CPU runner's
        warm-up skips under `CompilationMode.NONE` (`warming_up_model`), so its first step
        asserts `self.intermediate_tensors is not None` (vLLM 0.32, its default worker too)."""
        from vllm.config import CompilationMode
        from vllm.distributed.parallel_state import get_pp_group

        return (str(vllm_config.device_config.device_type) == "cpu" and not get_pp_group().is_first_rank
                and vllm_config.compilation_config.mode == CompilationMode.NONE)

    def supply_pp_buffers(self) -> bool:
        """Allocate them as `_dummy_run` would (once the model exists), where vLLM has not."""
        runner = self.runner
        if runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
        return True

    def install_faults(self, *, skip_dummy_forward: Callable[[], bool], skip_draft_sync: Callable[[], bool],
                       draft_steps_mismatch: Callable[[], bool] | None = None,
                       pcp_fault: Callable[[str], bool] | None = None,
                       demote_graph_mode: Callable[[], bool] | None = None) -> None:
        runner = self.runner

        def determine_then_maybe_skip(determine, args, kwargs):
            out = determine(*args, **kwargs)  # the dummy's DP agreement is in here
            if skip_dummy_forward():
                raise SkipDummyForward
            return out
        wrap_method(runner, "_determine_batch_execution_and_padding", determine_then_maybe_skip)
        wrap_method(runner, "_dummy_run", skipping_dummy)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and hasattr(drafter, "dummy_run"):
            wrap_method(drafter, "dummy_run",
                        lambda run, args, kwargs: None if skip_draft_sync() else run(*args, **kwargs))
