"""Start-up check that the installed vLLM still has every name the worker relies on.

The worker reads vLLM's dataclasses by field name, overrides its platform worker's methods,
is called by method name (the executor's `collective_rpc("execute_dummy_batch")`, ...) and
reads the model runner's persistent buffers by attribute. A vLLM release that renames any of
them would otherwise fail mid-step, or worse, silently skip a call (an idle DP replica never
told to run its dummy batch hangs its peers). `check_schema()` runs in the worker's
constructor, `check_runner()` once the runner exists; both raise `VLLMSchemaError` naming the
installed vLLM version and every missing name. Other modules of this package that rely on
more names add them to these tables.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any, Callable, Iterable

from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError
from runner_fsm.integrations.vllm.common.versions import KNOWN

WRITTEN_AGAINST = "0.32.0"  # the release the device emulation (`emulation/`) was written for

FIELDS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
        "total_num_scheduled_tokens", "scheduled_spec_decode_tokens", "finished_req_ids"),
    "vllm.v1.core.sched.output.NewRequestData": (
        "req_id", "prompt_token_ids", "prompt_embeds", "num_computed_tokens"),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "resumed_req_ids", "num_computed_tokens"),
    "vllm.v1.outputs.ModelRunnerOutput": ("sampled_token_ids",),
    "vllm.v1.outputs.DraftTokenIds": ("req_ids", "draft_token_ids"),
    "vllm.forward_context.ForwardContext": ("cudagraph_runtime_mode", "batch_descriptor", "dp_metadata"),
    "vllm.forward_context.BatchDescriptor": ("num_tokens", "num_reqs", "uniform"),
    "vllm.forward_context.DPMetadata": ("num_tokens_across_dp_cpu",),
}

SYMBOLS: list[str] = [
    "vllm.platforms.current_platform",
    "vllm.forward_context.get_forward_context",
    "vllm.forward_context.is_forward_context_available",
    "vllm.forward_context._forward_context",  # read directly by `forwards.forward_context` (per forward)
    "vllm.distributed.parallel_state.get_dp_group",
]

# Methods of the platform worker that FSMWorker overrides and calls through super().
OVERRIDDEN: tuple[str, ...] = (
    "init_device", "load_model", "determine_available_memory", "compile_or_warm_up_model",
    "execute_model", "sample_tokens", "execute_dummy_batch", "take_draft_token_ids",
    "check_health", "shutdown",
)

# What vLLM calls on every worker by name; the per-step ones must still be called.
CONTRACT: tuple[str, ...] = (
    "init_device", "load_model", "determine_available_memory", "compile_or_warm_up_model",
    "execute_model", "sample_tokens", "execute_dummy_batch", "take_draft_token_ids",
    "check_health", "shutdown",
)

# Where vLLM makes those calls: `collective_rpc("name", ...)` or `worker.name(...)`.
CALLER_MODULES: tuple[str, ...] = (
    "vllm.v1.executor.abstract", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.worker_base", "vllm.v1.engine.core",
)
_CALL = re.compile(r"""collective_rpc\(\s*["'](\w+)["']|worker\.(\w+)\(""")

def resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _field_names(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {})) | set(getattr(cls, "_fields", ()))


def called_names(sources: Iterable[str]) -> set[str]:
    """Method names vLLM calls on workers in the given source texts."""
    return {a or b for text in sources for a, b in _CALL.findall(text)}


def find_problems(worker_cls: type, *, lookup: Callable[[str], Any] = resolve,
                  sources: Iterable[str] | None = None) -> list[str]:
    """Every name `worker_cls` relies on that the installed vLLM lacks."""
    problems: list[str] = []
    for path, needed in FIELDS.items():
        try:
            have = _field_names(lookup(path))
        except (ImportError, AttributeError) as exc:
            problems.append(f"{path} is missing ({exc})")
            continue
        problems += [f"{path}.{f} is missing" for f in needed if f not in have]
    for path in SYMBOLS:
        try:
            lookup(path)
        except (ImportError, AttributeError):
            problems.append(f"{path} is missing")
    bases = [c for c in worker_cls.__mro__[1:] if c.__module__.startswith(("vllm", "vllm_ascend"))]
    for name in OVERRIDDEN:
        if not any(name in vars(c) for c in bases):
            problems.append(f"{bases[0].__qualname__ if bases else 'the platform worker'}.{name} is missing")
    if sources is None:
        sources = [inspect.getsource(importlib.import_module(m)) for m in CALLER_MODULES]
    called = called_names(sources)
    problems += [f"vLLM no longer calls worker method {name!r} (renamed?)" for name in CONTRACT if name not in called]
    return problems


def _raise(what: str, problems: list[str]) -> None:
    if problems:
        raise VLLMSchemaError(f"{what} was checked against vLLM {', '.join(KNOWN)}; the installed vLLM"
                              f" {installed_version()} does not match it: " + "; ".join(problems))


def check_schema(worker_cls: type, **kwargs: Any) -> None:
    """Raise `VLLMSchemaError` naming the installed vLLM version and every missing name."""
    _raise(worker_cls.__name__, find_problems(worker_cls, **kwargs))


def check_runner(adapter: Any, *, kv_cache: bool = False) -> None:
    """Every name the runner adapter reads, checked on the live runner (its class, not only
    vLLM's base class: a platform's runner may re-make or drop what the base has); with
    `kv_cache`, the names that exist once vLLM initialised the KV cache."""
    _raise("FSMWorker", adapter.problems(kv_cache=kv_cache))


def installed_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except (ImportError, AttributeError):
        return "(not importable)"
