"""Start-up check that the installed vLLM still has what the worker relies on.

The worker reads vLLM's dataclasses by field name and is called by method name (the
executor's `collective_rpc("execute_dummy_batch")`, ...). A vLLM release that renames either
would otherwise fail mid-step, or worse, never call a method (an idle DP replica that is never
told to run its dummy batch hangs its peers). `check_schema()` runs in the worker's
constructor and raises `VLLMSchemaError` naming the installed vLLM version and every problem.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any, Callable, Iterable

from runner_fsm.integrations.vllm.errors import VLLMSchemaError

WRITTEN_AGAINST = "0.32.0"

FIELDS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
        "total_num_scheduled_tokens", "scheduled_spec_decode_tokens", "finished_req_ids",
        "kv_cache_block_copies"),
    "vllm.v1.core.sched.output.NewRequestData": (
        "req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens"),
    "vllm.v1.core.sched.output.CachedRequestData": (
        "req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"),
    "vllm.v1.outputs.ModelRunnerOutput": ("req_ids", "req_id_to_index", "sampled_token_ids"),
    "vllm.v1.outputs.DraftTokenIds": ("req_ids", "draft_token_ids"),
    "vllm.v1.kv_cache_interface.KVCacheConfig": ("num_blocks", "kv_cache_groups"),
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec": ("layer_names", "kv_cache_spec"),
    "vllm.v1.kv_cache_interface.FullAttentionSpec": ("block_size", "num_kv_heads", "head_size", "dtype"),
}

SYMBOLS: tuple[str, ...] = (
    "vllm.v1.outputs.EMPTY_MODEL_RUNNER_OUTPUT",
    "vllm.v1.worker.worker_base.WorkerBase",
    "vllm.v1.worker.worker_base.CompilationTimes",
    "vllm.v1.worker.gpu_worker.init_worker_distributed_environment",
    "vllm.distributed.parallel_state.get_world_group",
    "vllm.distributed.parallel_state.get_dp_group",
    "vllm.distributed.parallel_state.get_pcp_group",
)

# WorkerBase methods the worker overrides, with their parameters after `self`.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "init_device": (),
    "load_model": ("load_dummy_weights",),
    "get_kv_cache_spec": (),
    "compile_or_warm_up_model": (),
    "execute_model": ("scheduler_output",),
    "sample_tokens": ("grammar_output",),
    "check_health": (),
    "shutdown": (),
}

# What vLLM calls on every worker by name, in its order; all implemented by FSMWorker.
CONTRACT: tuple[str, ...] = (
    "init_device", "load_model", "get_kv_cache_spec", "determine_available_memory",
    "initialize_from_config", "compile_or_warm_up_model", "get_supported_tasks",
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
    """Every mismatch between the installed vLLM and what `worker_cls` relies on."""
    problems: list[str] = []
    for path, needed in FIELDS.items():
        try:
            have = _field_names(lookup(path))
        except (ImportError, AttributeError) as exc:
            problems.append(f"{path} is missing ({exc})")
            continue
        missing = [f for f in needed if f not in have]
        if missing:
            problems.append(f"{path.rsplit('.', 1)[1]} lacks field(s) {missing}")
    for path in SYMBOLS:
        try:
            lookup(path)
        except (ImportError, AttributeError):
            problems.append(f"{path} is missing")
    try:
        base = lookup("vllm.v1.worker.worker_base.WorkerBase")
    except (ImportError, AttributeError):
        base = None
    for name, params in SIGNATURES.items():
        method = getattr(base, name, None) if base is not None else None
        if method is None:
            problems.append(f"WorkerBase.{name} is missing")
            continue
        have = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if have != params:
            problems.append(f"WorkerBase.{name}{have} now takes {list(have)}, the worker implements {list(params)}")
    if sources is None:
        sources = [inspect.getsource(importlib.import_module(m)) for m in CALLER_MODULES]
    called = called_names(sources)
    for name in CONTRACT:
        if not callable(getattr(worker_cls, name, None)):
            problems.append(f"{worker_cls.__name__}.{name} is not implemented")
        if name not in called:
            problems.append(f"vLLM no longer calls worker method {name!r} (renamed?)")
    return problems


def check_schema(worker_cls: type, **kwargs: Any) -> None:
    """Raise `VLLMSchemaError` naming the installed vLLM version and every problem found."""
    problems = find_problems(worker_cls, **kwargs)
    if problems:
        version = installed_version()
        raise VLLMSchemaError(
            f"{worker_cls.__name__} was written against vLLM {WRITTEN_AGAINST}; the installed vLLM"
            f" {version} does not match it: " + "; ".join(problems))


def installed_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except (ImportError, AttributeError):
        return "(not importable)"
