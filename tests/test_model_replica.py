"""The reference model and drafter behind the real `Replica` state machine, in one process.

Graph mode (the CPU static replay captured at start-up), drafting with a copy of the target
(every proposal accepted), and an idle step with a busy scripted peer (a dummy replayed
through the decode graph, then dummy drafts): greedy outputs equal plain greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from runner_fsm import dp
from runner_fsm.config import GraphMode
from runner_fsm.events import Capture, DummyStep, RealStep
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer
from runner_fsm.testing.harness import make_runner

from test_model_support import (
    CAPTURE_SIZES, Sequences, TargetDriver, batch, make_model_dirs, open_drafter, open_target, prompt,
    runner_config,
)

pytestmark = pytest.mark.asyncio

K = 2
PROMPTS = [prompt(10, 41), prompt(7, 42)]


def _greedy(target_dir, steps: int) -> list[list[int]]:
    driver, seqs = TargetDriver(open_target(target_dir), runner_config()), Sequences(PROMPTS)
    for step_id in range(steps):
        b = seqs.prefill() if step_id == 0 else seqs.decode()
        seqs.advance(b, driver.run(b, driver.agree_alone(b, step_id)).tokens)
    return seqs.tokens


def _verify_batch(seqs: list[list[int]], drafts: dict[str, list[int]], tables):
    ids = [f"r{i}" for i in range(len(seqs))]
    tokens = [t for s, rid in zip(seqs, ids) for t in [s[-1], *drafts[rid]]]
    return batch(ids, [1 + K] * len(ids), [False] * len(ids), [len(s) - 1 for s in seqs], tokens, tables,
                 num_draft_tokens=[K] * len(ids))


async def test_replica_runs_the_model_with_graphs_drafts_and_dummies(tmp_path):
    target_dir, _ = make_model_dirs(tmp_path)
    cfg = runner_config(graph_mode=GraphMode.FULL_DECODE_ONLY, num_speculative_tokens=K)
    peers = ScriptedPeers(busy_peer(4, graph_mode=dp.GRAPH_FULL, uniform=1 + K), capture_sizes=CAPTURE_SIZES)
    runner = make_runner(cfg, peers, model=open_target(target_dir), drafter=open_drafter(target_dir))
    await runner.handle(Capture())

    seqs = Sequences(PROMPTS)
    out = await runner.handle(RealStep(seqs.prefill()))
    tokens = [list(p) + out.sampled[f"r{i}"] for i, p in enumerate(PROMPTS)]
    drafts, graph_steps = out.drafts, []
    for step in range(4):
        if step == 1:
            cache = runner.replica.model.cache
            before = cache.k[:, :-1].clone(), cache.v[:, :-1].clone()  # the last slot is the spare
            idle = await runner.handle(DummyStep())
            assert idle.graph and idle.num_rows == 4  # the dummy replayed the 4-row graph
            # live requests' KV is byte-identical after the idle replica's dummy replay
            assert torch.equal(cache.k[:, :-1], before[0]) and torch.equal(cache.v[:, :-1], before[1])
            continue
        out = await runner.handle(RealStep(_verify_batch(tokens, drafts, seqs.tables)))
        graph_steps.append(out.graph)
        assert all(len(out.sampled[f"r{i}"]) == K + 1 for i in range(2)), out.sampled  # all accepted
        for i in range(2):
            tokens[i] += out.sampled[f"r{i}"]
        drafts = out.drafts
    assert graph_steps == [True, True, True]
    expected = _greedy(target_dir, 1 + 3 * (K + 1))
    assert tokens == expected
