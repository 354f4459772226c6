"""The paged, buffer-driven forward at P=1 against a plain float64 reference written here.

The reference knows nothing of pages, buffers or plans: one sequence, full causal attention,
a per-token loop over its experts, straight from the checkpoint's Hugging Face tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_fsm import dp
from runner_fsm.replica.components import ForwardStep
from runner_fsm.model import DispatchCountError, MixtralConfig, load_model
from runner_fsm.model_files.weights import read_checkpoint

from test_model_support import NUM_BLOCKS, Sequences, TargetDriver, make_model_dirs, open_target, prompt, runner_config

ATOL = 2e-3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_model_dirs(tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def reference(target_dir):
    return Reference(target_dir)


class Reference:
    """Dense float64 Mixtral over one whole sequence."""

    def __init__(self, model_dir):
        self.cfg = MixtralConfig.from_dir(model_dir)
        self.w = {k: v.double() for k, v in read_checkpoint(model_dir).items()}

    def logits(self, tokens: list[int]) -> np.ndarray:
        cfg, w = self.cfg, self.w
        h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = h + self._attention(self._norm(h, w[p + "input_layernorm.weight"]), p)
            h = h + self._experts(self._norm(h, w[p + "post_attention_layernorm.weight"]), p)
        return (self._norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T).numpy()

    def _norm(self, x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * weight

    def _rotate(self, x):  # x [L, heads, d]: pair i with i + d/2, angle pos * theta^(-2i/d)
        length, _, d = x.shape
        i = torch.arange(d // 2, dtype=torch.float64)
        angle = torch.arange(length, dtype=torch.float64)[:, None] * self.cfg.rope_theta ** (-2 * i / d)
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _attention(self, x, p):
        cfg, w = self.cfg, self.w
        length, d = x.shape[0], cfg.head_dim
        q = self._rotate((x @ w[p + "self_attn.q_proj.weight"].T).reshape(length, -1, d))
        k = self._rotate((x @ w[p + "self_attn.k_proj.weight"].T).reshape(length, -1, d))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(length, -1, d)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(length, -1)
        return out @ w[p + "self_attn.o_proj.weight"].T

    def _experts(self, x, p):
        w, k = self.w, self.cfg.num_experts_per_tok
        out = torch.zeros_like(x)
        top = (x @ w[p + "block_sparse_moe.gate.weight"].T).topk(k, dim=-1)
        gates = top.values.softmax(-1)
        for e in range(self.cfg.num_local_experts):
            e_ = f"{p}block_sparse_moe.experts.{e}."
            up = torch.nn.functional.silu(x @ w[e_ + "w1.weight"].T) * (x @ w[e_ + "w3.weight"].T)
            weight = (gates * (top.indices == e)).sum(-1, keepdim=True)
            out += weight * (up @ w[e_ + "w2.weight"].T)
        return out


class Checks:
    """Rows to compare with the reference once the sequences are final.

    Attention is causal, so one reference pass over a final sequence gives the logits of
    every earlier step's rows.
    """

    def __init__(self, reference, seqs):
        self.reference, self.seqs = reference, seqs
        self.rows = []  # (request, positions, logits, tokens)

    def add(self, b, result):
        start = 0
        for i, n in enumerate(b.num_scheduled):
            first = int(b.num_computed[i])
            rows = slice(start, start + n)
            self.rows.append((i, slice(first, first + n), result.logits[rows], result.tokens[rows]))
            start += n

    def verify(self):
        expected = [self.reference.logits(tokens) for tokens in self.seqs.tokens]
        for i, positions, logits, tokens in self.rows:
            np.testing.assert_allclose(logits, expected[i][positions], atol=ATOL, rtol=1e-3)
            assert tokens.tolist() == expected[i][positions].argmax(-1).tolist()
        return len(self.rows)


def test_prefill_then_decode_reuses_the_paged_cache(target_dir, reference):
    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(7, 1), prompt(13, 2), prompt(1, 3)])
    checks = Checks(reference, seqs)
    for step_id in range(4):
        b = seqs.prefill() if step_id == 0 else seqs.decode()
        result = driver.run(b, driver.agree_alone(b, step_id))
        checks.add(b, result)
        seqs.advance(b, result.tokens)
    assert [len(t) for t in seqs.tokens] == [11, 17, 5]
    assert checks.verify() == 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(target_dir, reference, dtype):
    """float64 matches the reference to rounding; bfloat16 runs and stays finite."""
    model = load_model(target_dir, kv_num_blocks=NUM_BLOCKS, block_size=4, dtype=dtype)
    driver = TargetDriver(model, runner_config())
    seqs = Sequences([prompt(6, 12), prompt(9, 13)])
    checks = Checks(reference, seqs)
    for step_id in range(2):
        b = seqs.prefill() if step_id == 0 else seqs.decode()
        result = driver.run(b, driver.agree_alone(b, step_id))
        checks.add(b, result)
        seqs.advance(b, result.tokens)
    if dtype == torch.float64:
        expected = [reference.logits(tokens) for tokens in seqs.tokens]
        for i, positions, logits, _ in checks.rows:
            np.testing.assert_allclose(logits, expected[i][positions], atol=1e-9, rtol=1e-9)
    else:
        assert all(np.isfinite(logits).all() for _, _, logits, _ in checks.rows)


def test_chunked_prefill_matches_one_pass(target_dir, reference):
    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(13, 4), prompt(6, 5)])
    checks = Checks(reference, seqs)
    for step_id, chunks in enumerate(([6, 2], [7, 4])):
        b = seqs.prefill(chunks)
        result = driver.run(b, driver.agree_alone(b, step_id))
        checks.add(b, result)
        seqs.advance(b, result.tokens)
    assert seqs.computed == [13, 6]
    b = seqs.decode()
    result = driver.run(b, driver.agree_alone(b, 2))
    checks.add(b, result)
    seqs.advance(b, result.tokens)
    assert checks.verify() == 6


def test_graph_path_equals_eager_path_for_uniform_decode(target_dir):
    eager = TargetDriver(open_target(target_dir), runner_config())
    graph = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(9, 6), prompt(4, 7), prompt(17, 8)])
    b = seqs.prefill()
    for driver in (eager, graph):
        first = driver.run(b, driver.agree_alone(b, 0))
    seqs.advance(b, first.tokens)
    for step_id in (1, 2, 3):
        b = seqs.decode()
        agreed = graph.agree_alone(b, step_id, graph=True)
        assert agreed.use_graph and agreed.num_tokens_across_dp == (4,)  # 3 rows padded to 4
        fixed = graph.run(b, agreed)
        loose = eager.run(b, eager.agree_alone(b, step_id))
        np.testing.assert_allclose(fixed.logits, loose.logits, atol=1e-4, rtol=1e-4)
        assert fixed.tokens.tolist() == loose.tokens.tolist()
        # Same cache contents too: the graph path wrote the same K/V to the same slots.
        torch.testing.assert_close(graph.model.cache.k[:, :-1], eager.model.cache.k[:, :-1])
        seqs.advance(b, fixed.tokens)


def test_dummy_rows_write_nothing_and_stay_finite(target_dir):
    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(11, 9)])
    b = seqs.prefill()
    driver.run(b, driver.agree_alone(b, 0))
    cache = driver.model.cache
    before = cache.k[:, :-1].clone(), cache.v[:, :-1].clone()
    # Eager: the idle replica agreed 0 tokens and runs 1 row; graph: the padded size.
    for graph_mode, agreed_count, rows in ((dp.GRAPH_EAGER, 0, 1), (dp.GRAPH_FULL, 4, 4)):
        agreed = dp.DPSyncState(1, dp.TARGET, (agreed_count,), graph_mode, 0, 1, False)
        out = driver.run_dummy(agreed)
        assert out.shape == (rows, driver.model.cfg.hidden_size) and torch.isfinite(out).all()
    assert torch.equal(cache.k[:, :-1], before[0]) and torch.equal(cache.v[:, :-1], before[1])


def test_wrong_dispatch_count_raises_before_any_row_is_used(target_dir):
    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(5, 10)])
    b = seqs.prefill()
    agreed = driver.agree_alone(b, 0)
    with pytest.raises(DispatchCountError, match=r"replica 0 .*sent 5 tokens to the DP agreement, but its batch dispatches 6") as info:
        driver.run(b, agreed, dispatch_count=6)
    assert (info.value.replica, info.value.reported, info.value.agreed, info.value.rows) == (0, 6, 5, 5)
    # Executing more rows than the exchange width fails even where counts are not compared.
    graph_agreed = dp.DPSyncState(1, dp.TARGET, (2,), dp.GRAPH_FULL, 1, 1, False)
    driver.buffers.write_dummy(1, 4)
    with pytest.raises(DispatchCountError, match="more than the exchange width 2"):
        driver.model.forward(driver.buffers, ForwardStep(1, 4, graph_agreed, 0, is_dummy=True))


def test_expert_partition_is_layout_free(target_dir):
    """Expert-parallel pieces summed in any order equal the one-rank result bit for bit."""
    from runner_fsm.model.moe import local_experts_dense, local_experts_eager, route
    from runner_fsm.model_files.weights import bind_weights

    cfg = MixtralConfig.from_dir(target_dir)
    state = read_checkpoint(target_dir)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full = bind_weights(cfg, state, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    ids, weights = route(x, full.layers[0].router, cfg.num_experts_per_tok)
    whole = local_experts_eager(x, ids, weights, full.layers[0].experts)
    for world in (2, 3, 4):
        parts = [local_experts_eager(x, ids, weights, bind_weights(
            cfg, state, rank=r, world_size=world, device=torch.device("cpu"), dtype=torch.float32,
        ).layers[0].experts) for r in range(world)]
        assert torch.equal(sum(parts), whole) and torch.equal(sum(reversed(parts)), whole)
    torch.testing.assert_close(local_experts_dense(x, ids, weights, full.layers[0].experts), whole)


def test_bad_slot_is_a_batch_error(target_dir):
    from runner_fsm.errors import BatchError

    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(3, 11)])
    seqs.tables[0] = [NUM_BLOCKS + 5] * 12  # a block id past the cache
    b = seqs.prefill()
    with pytest.raises(BatchError, match="outside the KV cache"):
        driver.run(b, driver.agree_alone(b, 0))
