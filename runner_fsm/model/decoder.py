"""The Mixtral decoder stack of one rank: embeddings, layers over a paged KV cache, final norm.

Used twice: by the target model (rows of one PCP rank; K/V all-gathered across the PCP group
before it is written) and by the replicated draft (global rows; no PCP gather).
"""

from __future__ import annotations

import dataclasses

import torch

from runner_fsm.model.attention import AttentionInputs, eager_attention, graph_attention
from runner_fsm.model.dispatch import DispatchHeader, ExchangeStep, check_headers, exchange_headers
from runner_fsm.model.exchange import RowRoles, gathered_bytes
from runner_fsm.model.kv_cache import PagedKVCache
from runner_fsm.model.layers import apply_rope, compute_dtype, rms_norm, rope_cos_sin, rope_inv_freq
from runner_fsm.model.moe import ROUTED, Traffic, moe_layer
from runner_fsm.model.parallel import ModelGroups, all_gather_rows
from runner_fsm.model_files.hf_config import MixtralConfig
from runner_fsm.model_files.weights import LayerWeights, MixtralWeights
from runner_fsm.replica import graphs


class MixtralDecoder:
    exchange = ROUTED  # eager steps' expert exchange; `moe.GATHERED` is the baseline (benchmarks)

    def __init__(self, cfg: MixtralConfig, weights: MixtralWeights, cache: PagedKVCache,
                 groups: ModelGroups, *, gather_kv_over_pcp: bool):
        self.cfg = cfg
        self.weights = weights
        self.cache = cache
        self.groups = groups
        self.gather_kv_over_pcp = gather_kv_over_pcp and groups.pcp_size > 1
        self.device = weights.embed.device
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, self.device, weights.embed.dtype)
        self.traffic = Traffic()

    @property
    def kv_gather_size(self) -> int:
        """How many ranks' rows make up the gathered K/V (and the slot mapping)."""
        return self.groups.pcp_size if self.gather_kv_over_pcp else 1

    def run(self, input_ids: torch.Tensor, inputs: AttentionInputs, step: ExchangeStep,
            roles: RowRoles) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] of the rows `input_ids` [N]."""
        if not step.use_graph:
            self.traffic.reset(self.exchange)
        else:
            # Outside any captured region: on a device graph this runs again before every replay.
            graphs.host_step(lambda step_id: self._check_graph_exchange(step, step_id), step.step_id)
        cos, sin = rope_cos_sin(inputs.positions, self.inv_freq)
        h = self.weights.embed[input_ids]
        for index, layer in enumerate(self.weights.layers):
            x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
            h = h + self._attention(index, layer, x, cos, sin, inputs, step.use_graph)
            x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
            h = h + moe_layer(x, layer.router, layer.experts, self.cfg.num_experts_per_tok,
                              layer=index, step=step, groups=self.groups, roles=roles,
                              traffic=self.traffic, exchange=self.exchange)
        return rms_norm(h, self.weights.norm, self.cfg.rms_norm_eps)

    def _check_graph_exchange(self, step: ExchangeStep, step_id: int) -> None:
        """A graph step's one header (layer -1): every rank replays the same step and size."""
        cfg, dtype = self.cfg, self.weights.embed.dtype
        at = dataclasses.replace(step, step_id=step_id, top_k=cfg.num_experts_per_tok)
        header = DispatchHeader(step_id, step.phase, -1, step.dispatch_count, step.rows)
        check_headers(exchange_headers(header, self.groups), at, self.groups)
        per_layer = gathered_bytes(step.width, cfg.hidden_size, cfg.num_experts_per_tok, self.groups.world_size,
                                   compute_dtype(dtype).itemsize, dtype.itemsize)
        self.traffic.reset("graph", per_layer, cfg.num_hidden_layers)

    def _attention(self, index: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, inputs: AttentionInputs, use_graph: bool) -> torch.Tensor:
        cfg = self.cfg
        q = (x @ layer.q_proj.T).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        k = (x @ layer.k_proj.T).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        v = (x @ layer.v_proj.T).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Every PCP rank needs every new K/V of the step: the cache is not sharded.
        kv = torch.stack([k, v], dim=1)
        if self.gather_kv_over_pcp:
            kv = all_gather_rows(kv, self.groups.pcp, self.groups.pcp_size)
        self.cache.write(index, inputs.slot_mapping, kv[:, 0], kv[:, 1])
        attend = graph_attention if use_graph else eager_attention
        out = attend(q, index, self.cache, inputs)
        return out.flatten(1) @ layer.o_proj.T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.weights.lm_head.T
        return logits.to(compute_dtype(logits.dtype))

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).argmax(dim=-1)
