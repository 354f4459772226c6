"""The PCP attention context of one step on one PCP rank: real or dummy.

A real context is derived from the step's ``PCPPlan``; a dummy context is derived from the
dummy batch alone (DESIGN.md section 6, ``idle_dummy``): an idle replica must never pick up
PCP attention state left over from its previous real batch. ``PCPContextState`` keeps the last
real context for whoever needs it, and its ``for_dummy`` never looks at it.

Each context records the step it was built for (``built_for_step``) and, through ``digest``, a
hash of the arrays the plan (or the dummy) determines: the gather order, the write mask and the
restore index. A forward logs both (``evidence.context_identity``) next to the same hash taken
from the step's own plan (``plan_digest``, ``dummy_digest``), so replay recomputes
``stale_context`` from what the forward used rather than from what the runner concluded.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.pcp.kv import dummy_slot_mapping, gathered_slot_mapping, slot_mapping
from runner_fsm.pcp.plan import PCPPlan


def _frozen(arr: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """A private read-only copy, so a context cannot change after it is built."""
    out = np.array(arr, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out


def _sealed(arr: np.ndarray) -> np.ndarray:
    """`arr`, made here and held by no one else, read-only from now on (no copy needed)."""
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class PCPAttentionContext:
    """Read-only step metadata; equal on all PCP ranks except pcp_rank (and slots under DCP)."""

    pcp_size: int
    pcp_rank: int
    num_tokens: int  # T: global tokens (for a dummy: its own N rows)
    num_tokens_padded: int  # N: rows every PCP rank executes
    block_tables: np.ndarray  # [R, B] global block tables (zeros for a dummy)
    global_slot_mapping: np.ndarray  # [T]
    gathered_slot_mapping: np.ndarray  # [P*N], PAD_SLOT_ID where nothing is written
    hidden_restore_idx: np.ndarray  # [T] gathered row holding global token t
    padded_gather_idx: np.ndarray  # [P*N] global token of each gathered row
    kv_write_mask: np.ndarray  # [P*N] rows whose K/V this step writes
    is_dummy: bool
    built_for_step: int | None = None  # the step whose plan (or dummy) it was built from

    @functools.cached_property
    def digest(self) -> int:
        """`layout_digest` of the arrays this context holds (computed once: they are read-only)."""
        return layout_digest(self.padded_gather_idx, self.kv_write_mask, self.hidden_restore_idx)

    def local_rows(self) -> slice:
        """This rank's rows of the gathered layout."""
        n = self.num_tokens_padded
        return slice(self.pcp_rank * n, (self.pcp_rank + 1) * n)

    def same_as(self, other: "PCPAttentionContext") -> bool:
        """Field-by-field equality (arrays compared by value, dtype and shape included)."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, np.ndarray):
                if mine.dtype != theirs.dtype or not np.array_equal(mine, theirs):
                    return False
            elif mine != theirs:
                return False
        return True


def layout_digest(padded_gather_idx, kv_write_mask, hidden_restore_idx) -> int:
    """crc32 of the gather order, write mask and restore index, in canonical dtypes: equal for a
    context and the plan (or dummy) it was built from, different for any other batch's."""
    digest = 0
    for arr, dtype in ((padded_gather_idx, np.int64), (kv_write_mask, np.bool_), (hidden_restore_idx, np.int64)):
        digest = zlib.crc32(np.ascontiguousarray(arr, dtype=dtype).tobytes(), digest)
    return digest


def plan_digest(plan: PCPPlan) -> int:
    """The digest a real context built from `plan` must have, taken from the plan itself."""
    return layout_digest(plan.padded_gather_idx, plan.kv_write_mask, plan.hidden_restore_idx)


def dummy_layout(num_tokens: int, pcp_size: int, pcp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(padded_gather_idx, kv_write_mask, hidden_restore_idx) of a dummy of `num_tokens` rows:
    every gathered row padding, nothing written, each rank restoring its own rows."""
    n, gathered = int(num_tokens), int(pcp_size) * int(num_tokens)
    return (np.zeros(gathered, dtype=np.int64), np.zeros(gathered, dtype=bool),
            int(pcp_rank) * n + np.arange(n, dtype=np.int64))


def dummy_digest(num_tokens: int, pcp_size: int, pcp_rank: int) -> int:
    """The digest the dummy context of `num_tokens` rows on `pcp_rank` must have."""
    return layout_digest(*dummy_layout(num_tokens, pcp_size, pcp_rank))


def _check_rank(pcp_size: int, pcp_rank: int) -> None:
    if not isinstance(pcp_size, (int, np.integer)) or pcp_size < 1:
        raise BatchError(f"pcp_size must be an integer >= 1, got {pcp_size!r}")
    if not isinstance(pcp_rank, (int, np.integer)) or not 0 <= pcp_rank < pcp_size:
        raise BatchError(f"pcp_rank must lie in [0, {pcp_size}), got {pcp_rank!r}")


def global_token_layout(plan: PCPPlan) -> tuple[np.ndarray, np.ndarray]:
    """(positions, req_idx) of every global token: the batch's own, which every rank's rows
    of the plan copy (a row's position is its request's computed tokens plus its offset)."""
    return plan.global_rows()


def build_real_context(
    plan: PCPPlan,
    pcp_rank: int,
    block_tables: np.ndarray,
    block_size: int,
    *,
    dcp_size: int = 1,
    dcp_rank: int | None = None,
    interleave: int = 1,
    step_id: int | None = None,
) -> PCPAttentionContext:
    """Context of a real batch on PCP rank ``pcp_rank``, built for step ``step_id``.

    Positions and requests come from the plan itself, so they cannot disagree with it.
    ``dcp_rank`` defaults to ``pcp_rank`` when ``dcp_size > 1`` (DCP spans the PCP group).
    """
    _check_rank(plan.pcp_size, pcp_rank)
    if dcp_rank is None:
        dcp_rank = pcp_rank if dcp_size > 1 else 0
    positions, req_idx = global_token_layout(plan)
    global_slots = slot_mapping(
        positions, req_idx, block_tables, block_size,
        dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave,
    )
    return PCPAttentionContext(
        pcp_size=plan.pcp_size,
        pcp_rank=int(pcp_rank),
        num_tokens=plan.num_tokens,
        num_tokens_padded=plan.num_tokens_padded,
        block_tables=_frozen(block_tables),
        global_slot_mapping=_sealed(global_slots),
        gathered_slot_mapping=_sealed(gathered_slot_mapping(global_slots, plan)),
        hidden_restore_idx=_frozen(plan.hidden_restore_idx),
        padded_gather_idx=_frozen(plan.padded_gather_idx),
        kv_write_mask=_frozen(plan.kv_write_mask, dtype=bool),
        is_dummy=False,
        built_for_step=step_id,
    )


def build_dummy_context(
    num_tokens: int,
    pcp_size: int,
    pcp_rank: int,
    *,
    num_reqs: int = 1,
    max_blocks_per_req: int = 1,
    step_id: int | None = None,
) -> PCPAttentionContext:
    """Context of a dummy batch of ``num_tokens`` rows per rank (for step ``step_id``), built
    from nothing else.

    Nothing is written (all slots ``PAD_SLOT_ID``, write mask all False, zeroed block
    tables), and each rank restores exactly its own rows: the dummy has no global order.
    """
    _check_rank(pcp_size, pcp_rank)
    for name, value in (("num_tokens", num_tokens), ("num_reqs", num_reqs),
                        ("max_blocks_per_req", max_blocks_per_req)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise BatchError(f"dummy {name} must be an integer >= 0, got {value!r}")
    n, gathered = int(num_tokens), int(pcp_size) * int(num_tokens)
    padded_gather_idx, kv_write_mask, hidden_restore_idx = dummy_layout(n, pcp_size, pcp_rank)
    return PCPAttentionContext(
        pcp_size=int(pcp_size),
        pcp_rank=int(pcp_rank),
        num_tokens=n,
        num_tokens_padded=n,
        block_tables=_frozen(np.zeros((num_reqs, max_blocks_per_req))),
        global_slot_mapping=_frozen(dummy_slot_mapping(n)),
        gathered_slot_mapping=_frozen(dummy_slot_mapping(gathered)),
        hidden_restore_idx=_sealed(hidden_restore_idx),
        padded_gather_idx=_sealed(padded_gather_idx),  # every row is padding
        kv_write_mask=_sealed(kv_write_mask),
        is_dummy=True,
        built_for_step=step_id,
    )


class PCPContextState:
    """Per-rank holder of the last real context; dummy steps neither read nor replace it."""

    def __init__(self, pcp_size: int, pcp_rank: int) -> None:
        _check_rank(pcp_size, pcp_rank)
        self.pcp_size = int(pcp_size)
        self.pcp_rank = int(pcp_rank)
        self.last_real: PCPAttentionContext | None = None

    def for_real(
        self, plan: PCPPlan, block_tables: np.ndarray, block_size: int, *, step_id: int | None = None,
        **kv_layout: int
    ) -> PCPAttentionContext:
        """Build the real context of ``plan`` (step ``step_id``) on this rank and remember it."""
        if plan.pcp_size != self.pcp_size:
            raise BatchError(f"plan is for pcp_size={plan.pcp_size}, this rank has {self.pcp_size}")
        ctx = build_real_context(plan, self.pcp_rank, block_tables, block_size, step_id=step_id, **kv_layout)
        self.last_real = ctx
        return ctx

    def for_dummy(
        self, num_tokens: int, *, num_reqs: int = 1, max_blocks_per_req: int = 1,
        step_id: int | None = None,
    ) -> PCPAttentionContext:
        """Build a dummy context from the dummy alone; ``last_real`` is never touched."""
        return build_dummy_context(
            num_tokens, self.pcp_size, self.pcp_rank,
            num_reqs=num_reqs, max_blocks_per_req=max_blocks_per_req, step_id=step_id,
        )
