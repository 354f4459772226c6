"""The blocked eager attention against the full [rows, seq_len] masked score matrix, in float64.

Segments longer than one query block (a chunked prefill that starts mid-request, a fresh
prompt) and a decode segment, with padding rows after them: every row must match the
full-matrix result within float64 rounding, and padding rows stay zero.
"""

from __future__ import annotations

import torch

from runner_fsm.model import attention
from runner_fsm.model.attention import AttentionInputs, eager_attention, graph_attention
from runner_fsm.model.kv_cache import PagedKVCache
from runner_fsm.model.layers import grouped_attention

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 8


def _case():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(num_layers=1, num_blocks=160, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=DIM,
                         dtype=torch.float64, device=torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen, dtype=torch.float64))
    # (first position, rows, block-table row): a continuation chunk, a fresh prompt, a decode.
    segments = [(300, 700, list(range(0, 64))), (0, 530, list(range(64, 100))), (90, 1, list(range(100, 108)))]
    tables = torch.zeros(len(segments), 64, dtype=torch.int32)
    positions, starts, seq_lens = [], [0], []
    for i, (start, rows, table) in enumerate(segments):
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        positions += list(range(start, start + rows))
        starts.append(starts[-1] + rows)
        seq_lens.append(start + rows)
    padding = 5
    positions += [0] * padding
    n = len(positions)
    inputs = AttentionInputs(
        positions=torch.tensor(positions), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.full((n,), -1), num_segments=len(segments))
    q = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)
    return q, cache, inputs, segments


def _full_matrix(q, cache, inputs, segments):
    out = torch.zeros_like(q)
    starts, seq_lens = inputs.query_start_loc.tolist(), inputs.seq_lens.tolist()
    for seg in range(len(segments)):
        a, b = starts[seg], starts[seg + 1]
        slots = cache.block_slots(inputs.block_tables[seg], seq_lens[seg])
        mask = torch.arange(seq_lens[seg])[None, :] <= inputs.positions[a:b, None]
        out[a:b] = grouped_attention(q[a:b], cache.k[0, slots], cache.v[0, slots], mask)
    return out


def test_blocked_attention_matches_full_score_matrix():
    q, cache, inputs, segments = _case()
    assert max(rows for _, rows, _ in segments) > 2 * attention.QUERY_BLOCK  # several blocks per segment
    blocked = eager_attention(q, 0, cache, inputs)
    full = _full_matrix(q, cache, inputs, segments)
    assert float((blocked - full).abs().max()) < 1e-12
    assert bool((blocked[-5:] == 0).all())


def test_graph_form_agrees_with_blocked_eager_form():
    q, cache, inputs, _ = _case()
    diff = (graph_attention(q, 0, cache, inputs) - eager_attention(q, 0, cache, inputs)).abs().max()
    assert float(diff) < 1e-12


def test_attention_is_computed_in_query_blocks_against_causal_key_prefixes(monkeypatch):
    """The blocking itself, not only its result: every score block is at most QUERY_BLOCK rows
    against the keys up to its last row's position (block counts and shapes written out by hand
    for the case's segments), so the largest score matrix is bounded by the block, and the
    scores computed are fewer than in the full [rows, seq_len] matrices (about half for a fresh prompt)."""
    q, cache, inputs, segments = _case()
    calls = []

    def recording(q_rows, keys, values, mask):
        calls.append((q_rows.shape[0], keys.shape[0]))
        return grouped_attention(q_rows, keys, values, mask)

    monkeypatch.setattr(attention, "grouped_attention", recording)
    eager_attention(q, 0, cache, inputs)
    assert attention.QUERY_BLOCK == 256  # the shapes below are for this block size
    # (query rows, keys) per block: the 700-row chunk from position 300, the 530-row prompt, the decode row
    assert calls == [(256, 556), (256, 812), (188, 1000),
                     (256, 256), (256, 512), (18, 530),
                     (1, 91)]
    full = sum(rows * (start + rows) for start, rows, _ in segments)
    assert sum(r * k for r, k in calls) < 0.8 * full  # 0.76 here: the chunk from position 300 sees 300 keys more
    assert max(r * k for r, k in calls) <= attention.QUERY_BLOCK * max(start + rows for start, rows, _ in segments)
