"""The DP agreement: one all-reduce per phase that makes every replica see the same step.

Each replica fills only its own column of an int64 ``[ROWS, dp_size]`` tensor of zeros; one
``all_reduce(SUM)`` on the DP group's gloo CPU group therefore gathers every column at once.
``agree`` is the pure rule over the gathered columns, so every replica that runs it on the same
columns reaches the same ``DPSyncState`` (or raises the same error) without a second collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from runner_fsm.agree.order import PHASE_NAMES as _ORDERED_PHASES, out_of_order
from runner_fsm.errors import DesyncError, ReplicaFault

# Phases of a step, each with its own agreement.
TARGET = 1
DRAFT_PREFILL = 2
DRAFT_DECODE = 3
PHASE_NAMES = {TARGET: "TARGET", DRAFT_PREFILL: "DRAFT_PREFILL", DRAFT_DECODE: "DRAFT_DECODE"}
assert PHASE_NAMES == _ORDERED_PHASES, "agree.order must order the phases this module sends"

# Graph modes as sent on the wire; the agreed mode is the minimum, so eager wins.
GRAPH_EAGER = 0
GRAPH_FULL = 2
GRAPH_MODE_NAMES = {GRAPH_EAGER: "eager", GRAPH_FULL: "full"}

# Status codes: anything but STATUS_OK aborts every replica.
STATUS_OK = 0
STATUS_BATCH_ERROR = 1
STATUS_FAULT = 2
STATUS_SHUTDOWN = 3
STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_BATCH_ERROR: "batch error",
    STATUS_FAULT: "fault",
    STATUS_SHUTDOWN: "shutdown",
}

ROWS = ("step_id", "phase", "status", "num_tokens", "graph_mode", "uniform_token_count", "num_reqs")
NUM_ROWS = len(ROWS)
_STEP, _PHASE, _STATUS, _TOKENS, _GRAPH, _UNIFORM, _REQS = range(NUM_ROWS)


# The shape each phase's agreement is handed to all_reduce with. The bytes are the same in every
# phase (the int64 [ROWS, dp_size] columns, row-major), and gloo sums them elementwise whatever
# the shape, so the agreement and its online desync check are unchanged. What differs is what
# PyTorch's Flight Recorder writes down (`input_sizes`): a replica that skipped its draft phase
# has its next TARGET agreement matched by gloo with its peers' DRAFT agreement (same op, same
# bytes), and without a phase-specific shape the dumps of that collective would look the same on
# every rank; with it, `runner-fsm replay` on the dumps alone sees where the ranks diverged.
def wire_shape(phase: int, dp_size: int) -> tuple[int, ...]:
    """The shape the agreement of `phase` is passed to all_reduce with (same bytes in every phase)."""
    if phase == DRAFT_PREFILL:
        return (NUM_ROWS * dp_size,)
    if phase == DRAFT_DECODE:
        return (1, NUM_ROWS * dp_size)
    return (NUM_ROWS, dp_size)


def phase_name(phase: int) -> str:
    return PHASE_NAMES.get(phase, f"phase {phase}")


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, "unknown")


@dataclasses.dataclass(frozen=True)
class LocalDispatch:
    """What one replica sends to the agreement: one int per row of the gathered tensor."""

    step_id: int
    phase: int
    status: int = STATUS_OK
    num_tokens: int = 0  # PCP-local dispatch count N, never the global token count
    graph_mode: int = GRAPH_EAGER
    uniform_token_count: int = 0  # 0 = the batch is not uniform
    num_reqs: int = 0

    def to_column(self) -> tuple[int, ...]:
        # Spelled out rather than looped over ROWS: this sits on the per-step hot path.
        return (
            self.step_id,
            self.phase,
            self.status,
            self.num_tokens,
            self.graph_mode,
            self.uniform_token_count,
            self.num_reqs,
        )

    @classmethod
    def from_column(cls, column: Sequence[int]) -> "LocalDispatch":
        if len(column) != NUM_ROWS:
            raise ValueError(f"a dispatch column has {NUM_ROWS} rows {ROWS}, got {len(column)}")
        return cls(*(int(value) for value in column))


@dataclasses.dataclass(frozen=True)
class DPSyncState:
    """The outcome of one DP agreement; identical on every replica."""

    step_id: int
    phase: int
    num_tokens_across_dp: tuple[int, ...]  # one entry per replica, padded when graph_mode is full
    graph_mode: int
    uniform_token_count: int
    num_reqs: int
    all_idle: bool

    @property
    def dp_size(self) -> int:
        return len(self.num_tokens_across_dp)

    @property
    def max_num_tokens(self) -> int:
        return max(self.num_tokens_across_dp)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_tokens_across_dp)

    @property
    def use_graph(self) -> bool:
        return self.graph_mode == GRAPH_FULL

    def num_tokens_for(self, dp_rank: int) -> int:
        """The number of rows replica `dp_rank` executes in this phase."""
        return self.num_tokens_across_dp[dp_rank]


def agree(columns: Sequence[LocalDispatch], *, capture_sizes: Sequence[int] = ()) -> DPSyncState:
    """The agreement rule over the gathered columns, one `LocalDispatch` per DP rank."""
    if not columns:
        raise ValueError("agree needs one LocalDispatch per replica, got an empty list")
    rows = [list(row) for row in zip(*(column.to_column() for column in columns))]
    return _agree_rows(rows, capture_sizes)


def sync(group, local: LocalDispatch, *, capture_sizes: Sequence[int] = ()) -> DPSyncState:
    """Run the one DP all-reduce on `group` (a gloo CPU group) and agree on its columns."""
    if group is None:
        group = dist.group.WORLD
    backend = dist.get_backend(group)
    if "gloo" not in backend:
        raise ValueError(
            f"the DP agreement runs on a gloo CPU group, got a {backend!r} group"
            f" (step {local.step_id}, {phase_name(local.phase)})"
        )
    gathered = pack(local, group.rank(), group.size())
    # A view of the same storage: the sum lands in `gathered` (see `wire_shape` for why).
    dist.all_reduce(gathered.view(wire_shape(local.phase, gathered.shape[1])), op=dist.ReduceOp.SUM, group=group)
    return _agree_rows(gathered.tolist(), capture_sizes)


def pack(local: LocalDispatch, dp_rank: int, dp_size: int) -> torch.Tensor:
    """The int64 [ROWS, dp_size] tensor replica `dp_rank` contributes: zeros but its column."""
    # A NumPy buffer shared with the tensor: filling a column costs no torch indexing ops.
    columns = np.zeros((NUM_ROWS, dp_size), dtype=np.int64)
    columns[:, dp_rank] = local.to_column()
    return torch.from_numpy(columns)


def unpack(gathered: torch.Tensor | Sequence[Sequence[int]]) -> list[LocalDispatch]:
    """The columns of a summed [ROWS, dp_size] tensor, one LocalDispatch per DP rank."""
    rows = gathered.tolist() if isinstance(gathered, torch.Tensor) else gathered
    if len(rows) != NUM_ROWS:
        raise ValueError(f"a gathered agreement has {NUM_ROWS} rows {ROWS}, got {len(rows)}")
    return [LocalDispatch.from_column(column) for column in zip(*rows)]


def _agree_rows(rows: list[list[int]], capture_sizes: Sequence[int]) -> DPSyncState:
    # A faulted replica may have left its step early, so its abort outranks a desync it causes.
    _raise_on_abort(rows)
    _validate(rows)
    _raise_on_desync(rows)
    step_id, phase = rows[_STEP][0], rows[_PHASE][0]
    num_reqs = max(rows[_REQS])
    counts = rows[_TOKENS]
    if not any(counts):
        # Nobody runs a forward, so no graph is replayed and nobody pads.
        return DPSyncState(step_id, phase, tuple(counts), GRAPH_EAGER, 0, num_reqs, True)
    uniform = _agree_uniform(rows[_UNIFORM])
    graph_mode = min(rows[_GRAPH])
    if uniform == 0 and any(rows[_UNIFORM]):
        graph_mode = GRAPH_EAGER  # a captured graph serves one uniform count, not several
    if graph_mode == GRAPH_FULL:
        padded = _capture_size_at_least(max(counts), capture_sizes)
        if padded is None:
            graph_mode = GRAPH_EAGER
        else:
            counts = [padded] * len(counts)
    return DPSyncState(step_id, phase, tuple(counts), graph_mode, uniform, num_reqs, False)


def _agree_uniform(values: list[int]) -> int:
    """The common non-zero uniform count, or 0 when replicas disagree or none sent one."""
    distinct = {value for value in values if value}
    return distinct.pop() if len(distinct) == 1 else 0


def _capture_size_at_least(num_tokens: int, capture_sizes: Sequence[int]) -> int | None:
    for size in capture_sizes:
        if size >= num_tokens:
            return size
    return None


def _raise_on_abort(rows: list[list[int]]) -> None:
    aborted = [rank for rank, status in enumerate(rows[_STATUS]) if status != STATUS_OK]
    if not aborted:
        return
    first = aborted[0]
    status, step = rows[_STATUS][first], rows[_STEP][first]
    reasons = "; ".join(
        f"replica {rank} sent status {rows[_STATUS][rank]} ({status_name(rows[_STATUS][rank])})"
        f" at step {rows[_STEP][rank]} ({phase_name(rows[_PHASE][rank])})"
        for rank in aborted
    )
    raise ReplicaFault(
        f"replica {first} aborted step {step} with status {status} ({status_name(status)});"
        f" every replica stops: {reasons}",
        replica=first,
        status=status,
    )


def _raise_on_desync(rows: list[list[int]]) -> None:
    steps, phases = rows[_STEP], rows[_PHASE]
    if min(steps) == max(steps) and min(phases) == max(phases):
        return
    sent = dict(enumerate(zip(steps, phases)))
    # The rule replay applies too (`agree.order`): majority, else the side ahead, else a tie.
    found = out_of_order(sent)
    each = ", ".join(
        f"replica {rank} sent step {step} {phase_name(phase)}"
        for rank, (step, phase) in sent.items()
    )
    raise DesyncError(
        f"DP desync: replicas disagree on step id or phase ({each}); {found.describe()}"
        + ("" if found.tie else " (skipped or repeated a collective)"),
        sent=sent, culprits=found.culprits, culprit_step=found.step,
    )


def _validate(rows: list[list[int]]) -> None:
    for rank, column in enumerate(zip(*rows)):
        step = column[_STEP]
        if column[_PHASE] not in PHASE_NAMES:
            raise ValueError(
                f"replica {rank} sent phase {column[_PHASE]} at step {step};"
                f" expected one of {sorted(PHASE_NAMES)}"
            )
        if column[_GRAPH] not in GRAPH_MODE_NAMES:
            raise ValueError(
                f"replica {rank} sent graph_mode {column[_GRAPH]} at step {step};"
                f" expected {GRAPH_EAGER} (eager) or {GRAPH_FULL} (full)"
            )
        for row in (_TOKENS, _UNIFORM, _REQS):
            if column[row] < 0:
                raise ValueError(
                    f"replica {rank} sent {ROWS[row]}={column[row]} at step {step}; expected >= 0"
                )


class GlooAgreement:
    """The replica's agreement: `sync` on its DP gloo group (the `Agreement` interface)."""

    def __init__(self, group, capture_sizes: Sequence[int] = ()):
        self.group = group
        self.capture_sizes = tuple(capture_sizes)

    def sync(self, local: LocalDispatch) -> DPSyncState:
        return sync(self.group, local, capture_sizes=self.capture_sizes)


class SingleReplicaAgreement:
    """The agreement of a run with one replica: the same rule over its one column."""

    def __init__(self, capture_sizes: Sequence[int] = ()):
        self.capture_sizes = tuple(capture_sizes)

    def sync(self, local: LocalDispatch) -> DPSyncState:
        return agree([local], capture_sizes=self.capture_sizes)
