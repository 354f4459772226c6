"""Speculative decoding: greedy verification of draft tokens.

A decode request with K draft tokens is scheduled as 1 + K verify rows: its last accepted
token followed by the drafts. The target's greedy token at row i is checked against draft
i + 1; the first mismatch is replaced by the target's token, and when every draft matches
the target's token after the last draft is a bonus. The output therefore never depends on
the drafts: it is exactly what greedy decoding without speculation would produce.
"""

from __future__ import annotations

import numpy as np

from runner_fsm.batch import ScheduledBatch


def verify_greedy(target_tokens, draft_tokens) -> list[int]:
    """Tokens to append: accepted drafts then one target token (1 .. K+1 tokens)."""
    target = [int(t) for t in target_tokens]
    drafts = [int(d) for d in draft_tokens]
    if len(target) != len(drafts) + 1:
        raise ValueError(f"verify needs 1 + K target tokens for K={len(drafts)} drafts, got {len(target)}")
    out = []
    for i, draft in enumerate(drafts):
        out.append(target[i])
        if target[i] != draft:
            return out
    out.append(target[-1])
    return out


def tokens_per_request(row_tokens: np.ndarray, batch: ScheduledBatch) -> dict[str, list[int]]:
    """Per request, what this step appends: greedy token of its last row, or verified drafts."""
    ends = np.cumsum(batch.num_scheduled)
    drafts = batch.num_draft_tokens
    if drafts is None or not drafts.any():  # one greedy token per request: its last row's
        return {rid: [token] for rid, token in zip(batch.req_ids, row_tokens[ends - 1].tolist())}
    starts = ends - batch.num_scheduled
    out: dict[str, list[int]] = {}
    for i, rid in enumerate(batch.req_ids):
        k = 0 if drafts is None else int(drafts[i])
        if k == 0:
            out[rid] = [int(row_tokens[ends[i] - 1])]
        else:
            rows = slice(ends[i] - 1 - k, ends[i])
            out[rid] = verify_greedy(row_tokens[rows], batch.token_ids[starts[i] + 1:ends[i]])
    return out
