"""Where `FSMWorker` meets each forward of vLLM's model: the hook right before it, and what
vLLM's forward context says of it (graph mode, batch descriptor, DP token counts).

Both run once per forward, right after vLLM's input preparation evicted the CPU caches, so
they touch as little as they can: vLLM's context read where its own getter reads it, no
property calls, the worker's method registered as the hook itself.
"""

from __future__ import annotations

from typing import Any

import torch

_VLLM_CONTEXT: Any = None  # the module vllm.forward_context, once imported


def forward_context() -> tuple[str, Any, Any]:
    """(graph mode name, batch descriptor as (tokens, reqs, uniform), DP token counts)."""
    global _VLLM_CONTEXT
    if _VLLM_CONTEXT is None:  # looked up once: a `from vllm import ...` per forward costs a call
        from vllm import forward_context  # into importlib

        _VLLM_CONTEXT = forward_context
    # The module's current context, read as `is_forward_context_available()` and
    # `get_forward_context()` read it (the schema check names it): two calls less a forward.
    ctx = _VLLM_CONTEXT._forward_context
    if ctx is None:
        return "NONE", None, None
    desc = ctx.batch_descriptor
    dp = ctx.dp_metadata
    # `_name_`, the member's plain attribute: `.name` is a Python-level property (two calls).
    return (ctx.cudagraph_runtime_mode._name_,
            (desc.num_tokens, desc.num_reqs, desc.uniform) if desc is not None else None,
            dp.num_tokens_across_dp_cpu.tolist() if dp is not None else None)


def hook_forward(model: Any, before) -> None:
    """Call `before(module, args, kwargs)` right before every call of the runner's `model`
    (`RunnerAdapter.model()`), real or dummy.

    A module gets a forward pre-hook (public API). On CUDA the model may be vLLM's
    `CUDAGraphWrapper` (not a module), whose `__call__` replays graphs: the only point right
    before a replay is that `__call__`, so the wrapper object gets a one-off subclass whose
    `__call__` runs `before` first (no global patch; isinstance checks still hold)."""
    if isinstance(model, torch.nn.Module):
        model.register_forward_pre_hook(before, with_kwargs=True)  # torch calls it: no lambda between
        return
    base = type(model)

    def __call__(self, *args, **kwargs):
        before(self, args, kwargs)
        return base.__call__(self, *args, **kwargs)

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
