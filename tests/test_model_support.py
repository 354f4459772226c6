"""Shared helpers of the model tests (no tests here): tiny checkpoints and a step driver.

`TargetDriver` runs one rank's target step the way `runner_fsm.replica.replica` does (plan, context,
buffers, forward, restore, sample) without the async runner, so a test can look at logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from runner_fsm import dp
from runner_fsm.batch import ScheduledBatch
from runner_fsm.replica.components import ForwardStep
from runner_fsm.config import ParallelLayout, RunnerConfig
from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, load_drafter, load_model, make_random_model
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.pcp.context import PCPContextState
from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

BLOCK_SIZE = 4
NUM_BLOCKS = 96
CAPTURE_SIZES = (1, 2, 4, 8)
TARGET_SEED, DRAFT_SEED = 0, 1


def runner_config(dp_size: int = 1, pcp_size: int = 1, **overrides) -> RunnerConfig:
    fields = dict(layout=ParallelLayout(dp_size=dp_size, pcp_size=pcp_size), max_num_reqs=4,
                  max_num_tokens=64, block_size=BLOCK_SIZE, max_blocks_per_req=16,
                  capture_sizes=CAPTURE_SIZES)
    fields.update(overrides)
    return RunnerConfig(**fields)


def make_model_dirs(root: Path) -> tuple[Path, Path]:
    """(target, draft) checkpoints under `root`, written once per root."""
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").exists():
        make_random_model(target, TARGET_SPEC, seed=TARGET_SEED)
        make_random_model(draft, DRAFT_SPEC, seed=DRAFT_SEED)
    return target, draft


def open_target(model_dir: Path, groups=None):
    return load_model(model_dir, kv_num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, groups=groups)


def open_drafter(model_dir: Path, groups=None):
    return load_drafter(model_dir, kv_num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, groups=groups)


def batch(req_ids, num_scheduled, is_prefilling, num_computed, token_ids, block_tables,
          num_draft_tokens=None) -> ScheduledBatch:
    return ScheduledBatch.build(req_ids, num_scheduled, is_prefilling, num_computed, token_ids,
                                block_tables, num_draft_tokens)


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # greedy token of every global row
    logits: np.ndarray  # [T, vocab] of every global row
    local: torch.Tensor  # this rank's forward output


class TargetDriver:
    """One rank's target steps, in the replica's order, with the agreement supplied by the caller."""

    def __init__(self, model, config: RunnerConfig, *, dp_rank: int = 0, pcp_rank: int = 0):
        self.model, self.config = model, config
        self.dp_rank, self.pcp_rank = dp_rank, pcp_rank
        self.buffers = PersistentBuffers(config)
        self.contexts = PCPContextState(config.layout.pcp_size, pcp_rank)

    def dispatch(self, b: ScheduledBatch, step_id: int, *, graph: bool = False) -> dp.LocalDispatch:
        n = num_tokens_for_dispatch(b.num_scheduled, b.is_prefilling, self.config.layout.pcp_size)
        uniform = b.uniform_query_len()
        mode = dp.GRAPH_FULL if graph and uniform else dp.GRAPH_EAGER
        return dp.LocalDispatch(step_id, dp.TARGET, dp.STATUS_OK, n, mode, uniform, b.num_reqs)

    def agree_alone(self, b: ScheduledBatch, step_id: int, *, graph: bool = False) -> dp.DPSyncState:
        return dp.agree([self.dispatch(b, step_id, graph=graph)], capture_sizes=self.config.capture_sizes)

    def run(self, b: ScheduledBatch, agreed: dp.DPSyncState, *, dispatch_count: int | None = None,
            use_graph: bool | None = None) -> StepResult:
        pcp = self.config.layout.pcp_size
        n = num_tokens_for_dispatch(b.num_scheduled, b.is_prefilling, pcp)
        padded = agreed.num_tokens_for(self.dp_rank)
        plan = plan_batch(b.num_scheduled, b.is_prefilling, b.num_computed, pcp, padded_num_tokens=padded)
        ctx = self.contexts.for_real(plan, b.block_tables, self.config.block_size)
        self.buffers.write_real(plan, self.pcp_rank, b.token_ids, b.block_tables, ctx.gathered_slot_mapping)
        if use_graph is not None:
            agreed = dataclasses.replace(agreed, graph_mode=dp.GRAPH_FULL if use_graph else dp.GRAPH_EAGER)
        count = n if dispatch_count is None else dispatch_count
        local = self.model.forward(self.buffers, ForwardStep(agreed.step_id, padded, agreed, count))
        restored = self.model.restore(local, ctx)
        return StepResult(self.model.sample(restored), self.model.logits(restored).numpy(), local)

    def run_dummy(self, agreed: dp.DPSyncState) -> torch.Tensor:
        rows = max(1, agreed.num_tokens_for(self.dp_rank))
        ctx = self.contexts.for_dummy(rows, num_reqs=1)
        self.buffers.write_dummy(1, rows)
        local = self.model.forward(self.buffers, ForwardStep(agreed.step_id, rows, agreed, 0, is_dummy=True))
        return self.model.restore(local, ctx)


def last_row_tokens(b: ScheduledBatch, row_tokens: np.ndarray) -> list[int]:
    return [int(row_tokens[i]) for i in np.cumsum(b.num_scheduled) - 1]


BLOCKS_PER_REQ = 12


def block_table(req: int) -> list[int]:
    """Request `req`'s scattered block ids (so paging bugs show); requests never share one."""
    return [(7 * (req * BLOCKS_PER_REQ + j) + 3) % NUM_BLOCKS for j in range(BLOCKS_PER_REQ)]


def prompt(length: int, seed: int, vocab: int = TARGET_SPEC.vocab) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, length).tolist()


class Sequences:
    """A tiny scheduler: requests with fixed block tables, greedy tokens appended per step."""

    def __init__(self, prompts, *, first_req: int = 0):
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.names = [f"r{first_req + i}" for i in range(len(prompts))]
        self.tables = [block_table(first_req + i) for i in range(len(prompts))]

    def prefill(self, chunks=None):
        """Schedule `chunks[i]` prompt tokens of request i (default: the whole rest)."""
        ids = range(len(self.tokens))
        sizes = [len(t) - c if chunks is None else chunks[i] for i, (t, c) in enumerate(zip(self.tokens, self.computed))]
        flat = [tok for i in ids for tok in self.tokens[i][self.computed[i]:self.computed[i] + sizes[i]]]
        return batch(self.names, sizes, [True] * len(sizes), list(self.computed), flat, self.tables)

    def decode(self):
        return batch(self.names, [1] * len(self.tokens), [False] * len(self.tokens),
                     list(self.computed), [t[-1] for t in self.tokens], self.tables)

    def advance(self, b, row_tokens):
        """Count the step's tokens as computed; a request whose prompt is done gets its token."""
        for i, tok in enumerate(last_row_tokens(b, row_tokens)):
            self.computed[i] += int(b.num_scheduled[i])
            if self.computed[i] == len(self.tokens[i]):
                self.tokens[i].append(tok)
