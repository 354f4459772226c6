"""The V1 model runner's DP sync, routed through the agreement tap (`dp/agreement.py`).

vLLM's V1 runner agrees on DP padding through `vllm.v1.worker.dp_utils._run_ar`: an int32
`[4, dp]` tensor (`VLLM_ROWS`), one column per rank, summed over the DP group; its callers read
rows 0-3 by index. `install` puts `run_ar_through(tap)` in its place, so the agreement rows ride
in that same collective, and tags the phase of each sync by where it is reached: the runner's
`_determine_batch_execution_and_padding` is TARGET, the drafter's a draft phase (`propose` and
`dummy_run` sync at most twice per step: first pass, then the remaining passes).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from runner_fsm import dp

VLLM_ROWS = ("orig_num_tokens", "padded_num_tokens", "should_ubatch", "cudagraph_mode")
RUN_AR_PARAMS = ("should_ubatch", "orig_num_tokens_per_ubatch", "padded_num_tokens_per_ubatch",
                 "cudagraph_mode", "parallel_config")


def run_ar_through(tap) -> Callable[..., torch.Tensor]:
    """vLLM's `_run_ar(should_ubatch, orig, padded, cudagraph_mode, parallel_config)`, the
    agreement rows of `tap` in its all-reduce."""
    from vllm.v1.worker import dp_utils

    def run_ar(should_ubatch: bool, orig_num_tokens_per_ubatch: int, padded_num_tokens_per_ubatch: int,
               cudagraph_mode: int, parallel_config) -> torch.Tensor:
        device, group = dp_utils._get_device_and_group(parallel_config)
        tensor = torch.zeros(len(VLLM_ROWS), tap.dp_size, dtype=torch.int32)
        tensor[:, tap.dp_rank] = torch.tensor((orig_num_tokens_per_ubatch, padded_num_tokens_per_ubatch,
                                               int(bool(should_ubatch)), cudagraph_mode), dtype=torch.int32)
        # vLLM's padded count is what the replica runs (its dispatch count); row 3 its graph mode.
        # A column of an unpadded eager step says nothing its count does not: not logged.
        plain = orig_num_tokens_per_ubatch == padded_num_tokens_per_ubatch and not should_ubatch \
            and not cudagraph_mode
        return tap.exchange(tensor, group, device=device, num_tokens_row=1, graph_row=3, log_column=not plain)
    return run_ar


def install(tap, runner) -> Callable[[], None]:
    """Route vLLM's DP sync through `tap` and tag its phases; returns the undo.

    `dp_utils._run_ar` is a module global that vLLM looks up at call time and offers no public
    hook for, so it is replaced there (`hooks.check_dp_hooks` verifies the name and signature
    against the installed vLLM first). The phase tags are instance attributes over the runner's
    and the drafter's `_determine_batch_execution_and_padding`, so the classes stay untouched.
    """
    from vllm.v1.worker import dp_utils

    original = dp_utils._run_ar
    dp_utils._run_ar = run_ar_through(tap)
    _wrap(runner, "_determine_batch_execution_and_padding", lambda: tap.tagged(dp.TARGET))
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "_determine_batch_execution_and_padding"):
        _wrap(drafter, "_determine_batch_execution_and_padding", lambda: tap.tagged(tap.draft_phase()))

    def undo() -> None:
        dp_utils._run_ar = original
        for obj in (runner, drafter):
            if obj is not None:
                obj.__dict__.pop("_determine_batch_execution_and_padding", None)
    return undo


def _wrap(obj, name: str, context: Callable[[], Any]) -> None:
    method = getattr(obj, name)

    @functools.wraps(method)
    def tagged(*args, **kwargs):
        with context():
            return method(*args, **kwargs)
    setattr(obj, name, tagged)


def dp_group(parallel_config) -> tuple[Any, Any]:
    """(device, group) of V1's DP sync collective."""
    from vllm.v1.worker import dp_utils

    return dp_utils._get_device_and_group(parallel_config)
