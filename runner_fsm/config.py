"""Runner configuration, its validation, and the rank topology of a DP x PCP job."""

from __future__ import annotations

import dataclasses
import enum

from runner_fsm.errors import ConfigError

CHUNKING_POLICIES = ("ceil", "balanced")


class GraphMode(enum.Enum):
    """Graph modes as vLLM names them; PCP with DP supports NONE and FULL_DECODE_ONLY only."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"


PCP_DP_GRAPH_MODES = (GraphMode.NONE, GraphMode.FULL_DECODE_ONLY)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions; identical on every rank."""

    dp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pcp_size

    def validate(self) -> "ParallelLayout":
        for name in ("dp_size", "pcp_size", "dcp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dcp_size not in (1, self.pcp_size):
            raise ConfigError(
                f"dcp_size must be 1 or equal to pcp_size={self.pcp_size}, got {self.dcp_size}"
            )
        if self.dcp_size > 1:
            # `pcp.kv.slot_mapping` computes DCP-sharded slots, but no cache here is sharded:
            # accepting the setting would silently run without DCP.
            raise ConfigError(
                f"dcp_size={self.dcp_size} is not supported: the reference model keeps each rank's"
                " whole KV cache (PCP gathers K/V, it does not shard it); use dcp_size=1"
            )
        return self

    # Rank mapping: the PCP ranks of one replica are contiguous global ranks.
    def global_rank(self, dp_rank: int, pcp_rank: int) -> int:
        if not (0 <= dp_rank < self.dp_size and 0 <= pcp_rank < self.pcp_size):
            raise ConfigError(
                f"(dp_rank, pcp_rank) must lie in [0, {self.dp_size}) x [0, {self.pcp_size}),"
                f" got ({dp_rank}, {pcp_rank})"
            )
        return dp_rank * self.pcp_size + pcp_rank

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(dp_rank, pcp_rank) of a global rank."""
        if not 0 <= global_rank < self.world_size:
            raise ConfigError(f"global rank must lie in [0, {self.world_size}), got {global_rank}")
        return divmod(global_rank, self.pcp_size)

    def dp_group_ranks(self) -> list[list[int]]:
        """One DP group per PCP rank: the ranks holding that PCP rank in every replica."""
        return [[self.global_rank(d, p) for d in range(self.dp_size)] for p in range(self.pcp_size)]

    def pcp_group_ranks(self) -> list[list[int]]:
        """One PCP group per replica: its pcp_size contiguous ranks."""
        return [[self.global_rank(d, p) for p in range(self.pcp_size)] for d in range(self.dp_size)]

    def expert_group_ranks(self) -> list[int]:
        """Experts are parallel over every rank (DP x PCP)."""
        return list(range(self.world_size))

    def groups_without_peers(self) -> tuple[str, ...]:
        """The process groups ("dp", "pcp", "expert") of one rank: nothing in them can wait on a peer."""
        sizes = {"dp": self.dp_size, "pcp": self.pcp_size, "expert": self.world_size}
        return tuple(name for name, size in sizes.items() if size == 1)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Everything a replica needs to know before it starts; identical on every rank."""

    layout: ParallelLayout = dataclasses.field(default_factory=ParallelLayout)
    graph_mode: GraphMode = GraphMode.NONE
    num_speculative_tokens: int = 0
    chunking: str = "ceil"
    # Capacities of the persistent buffers (per rank, rank-local rows).
    max_num_reqs: int = 16
    max_num_tokens: int = 2048
    max_num_segments: int | None = None  # default: 2 * max_num_reqs
    block_size: int = 16
    max_blocks_per_req: int = 64
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    collective_timeout_s: float = 60.0
    consensus: bool = False  # the replica's ranks compare their step decisions online (`step_consensus`)

    @property
    def num_segments(self) -> int:
        return self.max_num_segments if self.max_num_segments is not None else 2 * self.max_num_reqs

    def validate(self) -> "RunnerConfig":
        self.layout.validate()
        if not isinstance(self.graph_mode, GraphMode):
            raise ConfigError(f"graph_mode must be a GraphMode, got {self.graph_mode!r}")
        layout = self.layout
        if layout.dp_size > 1 and layout.pcp_size > 1 and self.graph_mode not in PCP_DP_GRAPH_MODES:
            raise ConfigError(
                f"PCP+DP (dp_size={layout.dp_size}, pcp_size={layout.pcp_size}) supports eager mode"
                f" (NONE) or FULL_DECODE_ONLY graphs only, got {self.graph_mode.name}"
            )
        if self.num_speculative_tokens < 0:
            raise ConfigError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if self.chunking not in CHUNKING_POLICIES:
            raise ConfigError(f"chunking must be one of {CHUNKING_POLICIES}, got {self.chunking!r}")
        for name in ("max_num_reqs", "max_num_tokens", "block_size", "max_blocks_per_req"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_segments < 2 * self.max_num_reqs:
            raise ConfigError(
                f"max_num_segments must hold 2 * max_num_reqs = {2 * self.max_num_reqs}"
                f" rank-local segments (a head and a tail chunk per request), got {self.num_segments}"
            )
        sizes = self.capture_sizes
        if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"capture_sizes must be positive and strictly increasing, got {sizes}")
        if sizes and sizes[-1] > self.max_num_tokens:
            raise ConfigError(
                f"largest capture size {sizes[-1]} exceeds max_num_tokens={self.max_num_tokens}"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        return self
