"""One configuration for an embedded-engine run, from which every part's config derives."""

from __future__ import annotations

import dataclasses

from runner_fsm.audit.segments import DEFAULT_MAX_LOG_BYTES
from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.engine.scheduler import SchedulerConfig
from runner_fsm.errors import ConfigError

# The dtypes the reference model loads weights in (model/loader.py).
DTYPES = ("float32", "float64", "float16", "bfloat16")


MISSING_MODEL = ("the embedded engine needs a model directory (model_dir) or a model_factory"
                 " ('module:function' returning (model, drafter))")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine run; identical on every rank (each derives its parts from it)."""

    model_dir: str | None  # the target model (or None with a model_factory)
    run_dir: str
    layout: ParallelLayout = dataclasses.field(default_factory=ParallelLayout)
    draft_dir: str | None = None
    num_speculative_tokens: int = 0
    graph_mode: GraphMode = GraphMode.NONE
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    chunking: str = "ceil"
    token_budget: int = 256
    max_num_reqs: int = 16
    num_kv_blocks: int = 512
    block_size: int = 16
    max_blocks_per_req: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings (preflight)
    collective_timeout_s: float = 60.0
    listen_address: str = "127.0.0.1"  # where rank 0's rendezvous store listens
    device: str = "cpu"
    dtype: str = "float32"
    run_id: str = "run"
    injections: tuple[str, ...] = ()
    progress_every: int = 0  # print a progress line every N steps from rank 0 (0: never)
    max_log_bytes: int | None = DEFAULT_MAX_LOG_BYTES  # per rank, every file it writes (None: no cap)
    compress_logs: bool = False  # closed log segments gzip-compressed
    # "module:function" building (model, drafter) from (config, groups) in each rank, instead
    # of loading model_dir: how tests and benchmarks run the engine with fakes.
    model_factory: str | None = None
    consensus: bool = False  # each replica's ranks compare their step decisions online (`step_consensus`)

    def runner_config(self) -> RunnerConfig:
        # A rank never executes more rows than the global budget, or a capture size above it.
        rows = max(self.token_budget, self.capture_sizes[-1] if self.capture_sizes else 1)
        return RunnerConfig(
            layout=self.layout, graph_mode=self.graph_mode,
            num_speculative_tokens=self.num_speculative_tokens, chunking=self.chunking,
            max_num_reqs=self.max_num_reqs, max_num_tokens=rows, block_size=self.block_size,
            max_blocks_per_req=self.max_blocks_per_req, capture_sizes=self.capture_sizes,
            collective_timeout_s=self.collective_timeout_s, consensus=self.consensus,
        ).validate()

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
            max_blocks_per_req=self.max_blocks_per_req, token_budget=self.token_budget,
            max_num_reqs=self.max_num_reqs, num_speculative_tokens=self.num_speculative_tokens,
            max_model_len=self.max_model_len)

    def validate(self) -> "EngineConfig":
        self.runner_config()
        if self.model_dir is None and self.model_factory is None:
            raise ConfigError(MISSING_MODEL)
        if self.num_speculative_tokens > 0 and self.model_dir is not None and self.draft_dir is None:
            raise ConfigError("num_speculative_tokens > 0 needs a draft model (draft_dir)")
        if self.token_budget < 1 + self.num_speculative_tokens:
            raise ConfigError(f"token_budget={self.token_budget} cannot hold one verify row of"
                              f" 1 + {self.num_speculative_tokens} tokens")
        if self.num_kv_blocks < 1 or self.block_size < 1:
            raise ConfigError(f"num_kv_blocks and block_size must be >= 1, got {self.num_kv_blocks}"
                              f" and {self.block_size}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        from runner_fsm.faults import Injection, static_problem  # parsing raises on an unknown kind

        for text in self.injections:
            problem = static_problem(Injection.parse(text), self.layout.dp_size, self.layout.pcp_size,
                                     self.num_speculative_tokens)
            if problem is not None:  # it could never fire: the run would end as if never asked
                raise ConfigError(problem)
        return self
