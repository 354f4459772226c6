"""The baseline of the planning benchmark: DESIGN.md section 3 written the obvious way.

Plain Python lists and loops, per request and per token, with the "ceil" chunking, the way
one would first write it (and the way per-request planners are written in Python engines).
It produces the same per-rank rows, per-segment metadata and the three index arrays as
`runner_fsm.pcp.plan.plan_batch`, as NumPy arrays at the end, so the two can be compared
value by value and timed on the same batch.
"""

from __future__ import annotations


def naive_plan(num_scheduled, is_prefilling, num_computed, pcp_size: int) -> dict:
    import numpy as np

    num_reqs = len(num_scheduled)
    num_chunks = 2 * pcp_size
    req_start = []
    total = 0
    for length in num_scheduled:
        req_start.append(total)
        total += length

    ranks = []
    for r in range(pcp_size):
        segments = []  # (req, offset, length), in request order
        for i in range(num_reqs):
            length = num_scheduled[i]
            if not is_prefilling[i] or pcp_size == 1:
                segments.append((i, 0, length))
                continue
            chunk = -(-length // num_chunks)
            for c in (r, num_chunks - 1 - r):  # head, then tail
                start = c * chunk
                size = min(chunk, max(0, length - start))
                if size > 0:
                    segments.append((i, start, size))
        # Stable: pure prefill segments (starting at absolute position 0) go last.
        mixed = [s for s in segments if not (is_prefilling[s[0]] and num_computed[s[0]] + s[1] == 0)]
        pure = [s for s in segments if is_prefilling[s[0]] and num_computed[s[0]] + s[1] == 0]
        token_idx, req_idx, positions = [], [], []
        query_start_loc, seq_lens, seg_req_idx = [0], [], []
        for i, offset, size in mixed + pure:
            for t in range(offset, offset + size):
                token_idx.append(req_start[i] + t)
                req_idx.append(i)
                positions.append(num_computed[i] + t)
            query_start_loc.append(query_start_loc[-1] + size)
            seq_lens.append(num_computed[i] + offset + size)
            seg_req_idx.append(i)
        ranks.append({"token_idx": token_idx, "req_idx": req_idx, "positions": positions,
                      "query_start_loc": query_start_loc, "seq_lens": seq_lens,
                      "seg_req_idx": seg_req_idx})

    n = max(len(rank["token_idx"]) for rank in ranks) if ranks else 0
    gather_idx, write_mask = [], []
    restore = [0] * total
    for r, rank in enumerate(ranks):
        for k, (t, i) in enumerate(zip(rank["token_idx"], rank["req_idx"])):
            gather_idx.append(t)
            owned = r == 0 or bool(is_prefilling[i])  # a decode row: rank 0's copy only
            write_mask.append(owned)
            if owned:
                restore[t] = r * n + k
        pad = n - len(rank["token_idx"])
        gather_idx.extend([0] * pad)
        write_mask.extend([False] * pad)

    return {
        "num_tokens_padded": n,
        "per_rank_num_tokens": tuple(len(rank["token_idx"]) for rank in ranks),
        "padded_gather_idx": np.array(gather_idx, dtype=np.int64),
        "kv_write_mask": np.array(write_mask, dtype=bool),
        "hidden_restore_idx": np.array(restore, dtype=np.int64),
        "ranks": [{key: np.array(value, dtype=np.int64) for key, value in rank.items()} for rank in ranks],
    }


def assert_same_plan(plan, naive: dict) -> None:
    """Raise AssertionError unless `plan` (a PCPPlan) equals the baseline's output."""
    import numpy as np

    assert plan.num_tokens_padded == naive["num_tokens_padded"], "num_tokens_padded differs"
    assert tuple(plan.per_rank_num_tokens) == naive["per_rank_num_tokens"], "per-rank counts differ"
    for name in ("padded_gather_idx", "kv_write_mask", "hidden_restore_idx"):
        mine, theirs = getattr(plan, name), naive[name]
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), f"{name} differs"
    for r, (rank, theirs) in enumerate(zip(plan.ranks, naive["ranks"])):
        for name, value in theirs.items():
            assert np.array_equal(getattr(rank, name), value), f"rank {r}: {name} differs"
