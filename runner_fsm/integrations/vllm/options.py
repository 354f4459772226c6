"""The worker's own options and the runner configuration derived from vLLM's config.

Options come from `additional_config={"runner_fsm": {...}}` (`--additional-config` on
`vllm serve`), else from `RUNNER_FSM_*` environment variables, else from vLLM's config:

| key                   | env                              | default                              |
|-----------------------|----------------------------------|--------------------------------------|
| run_dir               | RUNNER_FSM_RUN_DIR               | runs/vllm-<time> (chosen by rank 0)  |
| run_id                | RUNNER_FSM_RUN_ID                | the run directory's name             |
| graph_mode            | RUNNER_FSM_GRAPH_MODE            | vLLM's cudagraph_mode (NONE on CPU)  |
| capture_sizes         | RUNNER_FSM_CAPTURE_SIZES         | vLLM's capture sizes, else 1,2,4,8,16|
| chunking              | RUNNER_FSM_CHUNKING              | ceil                                 |
| collective_timeout_s  | RUNNER_FSM_COLLECTIVE_TIMEOUT_S  | 120                                  |

Duck-typed on vLLM's config objects (no vLLM import).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.errors import UnsupportedFeatureError

CONFIG_KEY = "runner_fsm"
ENV_PREFIX = "RUNNER_FSM_"
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16)
SUPPORTED_SPEC_METHOD = "draft_model"


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How the worker runs its replica; identical on every rank of a vLLM job."""

    run_dir: str | None = None  # None: rank 0 picks runs/vllm-<time> and shares it
    run_id: str | None = None
    graph_mode: GraphMode = GraphMode.NONE
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    chunking: str = "ceil"
    collective_timeout_s: float = 120.0

    @classmethod
    def from_vllm(cls, vllm_config: Any, environ: Mapping[str, str] = os.environ) -> "WorkerOptions":
        given = _additional(vllm_config)
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"additional_config[{CONFIG_KEY!r}] has unknown keys {unknown};"
                              f" known: {[f.name for f in dataclasses.fields(cls)]}")

        def pick(name: str):
            if name in given:
                return given[name]
            return environ.get(ENV_PREFIX + name.upper()) or None

        mode, sizes = _vllm_graphs(vllm_config)
        raw_mode, raw_sizes = pick("graph_mode"), pick("capture_sizes")
        timeout = pick("collective_timeout_s")
        return cls(
            run_dir=pick("run_dir"),
            run_id=pick("run_id"),
            graph_mode=_graph_mode(raw_mode) if raw_mode is not None else mode,
            capture_sizes=_sizes(raw_sizes) if raw_sizes is not None else (sizes or DEFAULT_CAPTURE_SIZES),
            chunking=pick("chunking") or "ceil",
            collective_timeout_s=float(timeout) if timeout is not None else cls.collective_timeout_s,
        )


def _additional(vllm_config: Any) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get(CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config[{CONFIG_KEY!r}] must be a mapping, got {section!r}")
    return dict(section)


def _graph_mode(value: Any) -> GraphMode:
    if isinstance(value, GraphMode):
        return value
    try:
        return GraphMode(str(value).lower())
    except ValueError:
        raise ConfigError(f"graph_mode must be one of {[m.value for m in GraphMode]}, got {value!r}") from None


def _sizes(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    try:
        return tuple(int(x) for x in items if str(x).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"capture_sizes must be integers, got {value!r}") from None


def _vllm_graphs(vllm_config: Any) -> tuple[GraphMode, tuple[int, ...]]:
    """vLLM's graph mode as the runner's: full decode graphs map to FULL_DECODE_ONLY."""
    compilation = vllm_config.compilation_config
    name = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    sizes = tuple(sorted(set(compilation.cudagraph_capture_sizes or ())))
    full_decode = name in ("FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE")
    return (GraphMode.FULL_DECODE_ONLY if full_decode else GraphMode.NONE), sizes


def check_supported(vllm_config: Any) -> None:
    """Refuse, at start-up and by name, every vLLM setting the runner does not implement."""
    par, model = vllm_config.parallel_config, vllm_config.model_config
    problems = []
    for name, what in (("tensor_parallel_size", "tensor parallelism"),
                       ("pipeline_parallel_size", "pipeline parallelism"),
                       ("decode_context_parallel_size", "decode context parallelism")):
        if getattr(par, name, 1) > 1:
            problems.append(f"{name}={getattr(par, name)} ({what}: a replica is split only by PCP)")
    if getattr(vllm_config, "lora_config", None) is not None:
        problems.append("LoRA adapters")
    if getattr(model, "quantization", None):
        problems.append(f"quantization={model.quantization!r}")
    if getattr(vllm_config.cache_config, "cache_dtype", "auto") != "auto":
        problems.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} (the KV cache has the model's dtype)")
    if getattr(model, "logits_processors", None):
        problems.append("custom logits processors")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("KV transfer (disaggregated prefill)")
    if getattr(model, "runner_type", "generate") != "generate":
        problems.append(f"runner={model.runner_type!r} (generation only)")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and spec.method != SUPPORTED_SPEC_METHOD:
        problems.append(f"speculative method {spec.method!r} (only {SUPPORTED_SPEC_METHOD!r}: a separate"
                        f" Mixtral draft model, run replicated by the runner)")
    if problems:
        raise UnsupportedFeatureError("FSMWorker does not support: " + "; ".join(problems))


def num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens) if spec is not None else 0


def layout_of(vllm_config: Any) -> ParallelLayout:
    par = vllm_config.parallel_config
    return ParallelLayout(dp_size=int(par.data_parallel_size),
                          pcp_size=int(getattr(par, "prefill_context_parallel_size", 1))).validate()


def runner_config(vllm_config: Any, options: WorkerOptions, block_size: int) -> RunnerConfig:
    """The replica's configuration: vLLM's limits, block size and speculation, our options."""
    sched = vllm_config.scheduler_config
    k = num_speculative_tokens(vllm_config)
    rows = int(sched.max_num_batched_tokens)
    sizes = tuple(s for s in options.capture_sizes if s <= rows)
    max_len = int(vllm_config.model_config.max_model_len) + k  # the drafter's lookahead
    return RunnerConfig(
        layout=layout_of(vllm_config), graph_mode=options.graph_mode,
        num_speculative_tokens=k, chunking=options.chunking,
        max_num_reqs=int(sched.max_num_seqs), max_num_tokens=rows, block_size=int(block_size),
        max_blocks_per_req=-(-max_len // int(block_size)), capture_sizes=sizes,
        collective_timeout_s=options.collective_timeout_s,
    ).validate()
