"""Build a runner around fakes (or real parts) in one call, for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from runner_fsm.agree.collectives import CollectiveRunner
from runner_fsm.audit import AuditLog
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.batch import ScheduledBatch
from runner_fsm.config import RunnerConfig
from runner_fsm.dp import SingleReplicaAgreement
from runner_fsm.pcp.buffers import BUFFER_NAMES
from runner_fsm.replica.driver import ReplicaRunner
from runner_fsm.replica.replica import Replica
from runner_fsm.testing.fakes import FakeDrafter, FakeModel


def make_runner(config: RunnerConfig, agreement, *, run_dir=None, run_id: str = "test",
                model=None, drafter=None, dp_rank: int = 0, pcp_rank: int = 0,
                on_close=None, injector=None) -> ReplicaRunner:
    layout = config.layout
    global_rank = layout.global_rank(dp_rank, pcp_rank)
    shape = job_shape_fields(layout.dp_size, layout.pcp_size, dp_rank, pcp_rank, buffer_names=list(BUFFER_NAMES))
    audit = AuditLog(run_dir, run_id, global_rank, dp_rank, pcp_rank, shape=shape) if run_dir is not None else None
    if drafter is None and config.num_speculative_tokens > 0:
        drafter = FakeDrafter(config.num_speculative_tokens)
    # Only the single-replica agreement is known to have no peers; other fakes may act one out.
    inline = layout.groups_without_peers() if isinstance(agreement, SingleReplicaAgreement) else ()
    replica = Replica(
        config, dp_rank=dp_rank, pcp_rank=pcp_rank, model=model or FakeModel(), agreement=agreement,
        collectives=CollectiveRunner(audit, config.collective_timeout_s, inline_groups=inline),
        audit=audit, drafter=drafter, **({"injector": injector} if injector else {}),
    )
    return ReplicaRunner(replica, on_close=on_close)


def prefill_batch(lengths, *, first_block: int = 0, block_size: int = 16, seed: int = 0) -> ScheduledBatch:
    """Fresh prompts of the given lengths, with enough KV blocks each."""
    rng = np.random.default_rng(seed)
    blocks = max(-(-n // block_size) for n in lengths)
    tables = [[first_block + i * blocks + j for j in range(blocks)] for i in range(len(lengths))]
    return ScheduledBatch.build(
        [f"req-{first_block + i}" for i in range(len(lengths))], lengths, [True] * len(lengths),
        [0] * len(lengths), rng.integers(1, 900, int(sum(lengths))), tables)


def decode_batch(computed, *, first_block: int = 0, block_size: int = 16, seed: int = 1,
                 num_draft_tokens=None, cached_prefix: bool = False) -> ScheduledBatch:
    """One decode row (1 + K verify tokens) per request that has `computed` tokens.

    `cached_prefix`: the requests are new to the replica, their prefix already cached."""
    rng = np.random.default_rng(seed)
    drafts = [0] * len(computed) if num_draft_tokens is None else list(num_draft_tokens)
    scheduled = [1 + k for k in drafts]
    blocks = max(-(-(c + s) // block_size) for c, s in zip(computed, scheduled))
    tables = [[first_block + i * blocks + j for j in range(blocks)] for i in range(len(computed))]
    return ScheduledBatch.build(
        [f"req-{first_block + i}" for i in range(len(computed))], scheduled, [False] * len(computed),
        computed, rng.integers(1, 900, sum(scheduled)), tables,
        num_draft_tokens=drafts if num_draft_tokens is not None else None,
        cached_prefix_req_ids=[f"req-{first_block + i}" for i in range(len(computed))] if cached_prefix else ())
