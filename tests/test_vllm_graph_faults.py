"""Graph-replay faults named through vLLM (`make test-vllm-device`: the emulated device
configuration, Model Runner V2, FULL_DECODE_ONLY graphs of sizes 1/2/4/8).

Each fault is injected through the worker option `inject`, on replica 0 in one run and on the
last replica in another; replay must name its kind, replica and step (and rank) from copies of
the logs that hold no `fault` or `injected` record (`stripped`): from the evidence alone.

- `skip-input-refresh`: the step's graph replay reads the inputs the step before left; replay
  names `stale_buffer_replay` from the `buffers` record of the replay, and the replica's tokens
  change (the fault acted: the forward ran on the previous step's inputs).
- `demote-graph-mode`: the idle replica asks for eager in vLLM's DP sync, so vLLM runs every
  replica eager for the step; replay names `graph_mode_demoted` from the agreement records.
- `rank-graph-mode` (PCP=2, one replica): rank K runs the step eager while its peer replays;
  replay names `replica_divergence` at rank K, though two ranks have no majority: the rank that
  ran eager a batch its peer replayed, with a graph of that size captured, is the one.
"""

from __future__ import annotations

import pytest
import vllm_dp_cases as c
from vllm_checks import graph_records, hf_greedy, records

import vllm_harness as h

pytestmark = [pytest.mark.vllm, pytest.mark.device]

SIZES = [1, 2, 4, 8]
GRAPHS = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": SIZES}}
# Both replicas decode through step 6 (real steps the fault can act on); the second one's
# request ends first, so it idles from step ~8 while the first still decodes.
BUSY = [[("a", c.prompt(12, 1), 14), ("b", c.prompt(9, 2), 12)], [("c", c.prompt(7, 3), 8)]]


def _faulted_run(tmp_path, models, injection: str, per_rank):
    from runner_fsm.integrations.vllm.offline_dp import Job

    run_dir = tmp_path / "run"
    kw = {**c.kwargs(models, "mixtral", drafting=False, run_dir=str(run_dir), options={"inject": injection},
                     executor=c.VLLM_DEFAULT_LAYOUT), **GRAPHS}
    result = c.run([Job(kw, per_rank)], 2, tmp_path)
    assert result.codes == [0, 0], result.logs[-1][-4000:]
    tokens = {rid: toks for per_rank_out in result.outputs[0] for rid, toks in per_rank_out.items()}
    return run_dir, tokens


def _found(run_dir) -> list[tuple]:
    from runner_fsm.replay.judge import replay

    report = replay(c.stripped(run_dir))
    # the stripped copy holds no `injected` record: that the injection never fired is no finding here
    return [(v.kind, v.replica, v.step, v.ranks) for v in report.verdicts if v.kind != "injection_not_fired"], \
        report.format()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return c.make_models(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("replica,step", [(0, 5), (1, 4)])
def test_skip_input_refresh_is_named_from_the_replay_buffers(tmp_path, models, replica, step):
    """DP=2: replica R's graph replay at step S reads the previous step's inputs. Replay of the
    stripped logs names `stale_buffer_replay` at R, S and nothing else; the step did replay a
    graph; R's tokens differ from Hugging Face's greedy ones (the fault acted) while the other
    replica's equal them. Fails on a worker without the fault (nothing named, tokens equal), and
    with the write stamp moved by the restore (nothing named)."""
    run_dir, tokens = _faulted_run(tmp_path, models, f"skip-input-refresh@replica={replica},step={step}", BUSY)
    replayed = {r["step_id"] for r in graph_records(run_dir, "replay", replica) if not r["dummy"]}
    assert step in replayed, (step, replayed)
    found, text = _found(run_dir)
    # one rank a replica: its global rank is the replica's
    assert found == [("stale_buffer_replay", replica, step, (replica,))], text
    reference = {rid: hf_greedy(models["mixtral"], {rid: list(prompt)}, n)[rid]
                 for per_rank in BUSY for rid, prompt, n in per_rank}
    for rank, per_rank in enumerate(BUSY):
        same = all(tokens[rid] == reference[rid] for rid, _, _ in per_rank)
        assert same == (rank != replica), (rank, tokens, reference)


@pytest.mark.parametrize("idle", [0, 1])
def test_demote_graph_mode_is_named_from_the_agreements(tmp_path, models, idle):
    """DP=2: the idle replica (0 in one run, 1 in the other) asks for eager in vLLM's DP sync at
    step S while the other decodes: vLLM runs both eager for S (no replay at S on either; the
    agreement's `graph_mode` eager), and replay of the stripped logs names `graph_mode_demoted`
    at that replica and step, and nothing else. Fails with `_proposed` reading no vLLM column
    (nothing named), and on a worker without the fault (both replay at S)."""
    per_rank = [[("a", c.prompt(12, 1), 14)], [("c", c.prompt(7, 3), 2)]]
    if idle == 0:
        per_rank = per_rank[::-1]
    step = 8
    run_dir, _ = _faulted_run(tmp_path, models, f"demote-graph-mode@replica={idle},step={step}", per_rank)
    kinds = {r["step_id"]: r["trigger"] for r in records(run_dir, idle)
             if r["event"] == "transition" and r["trigger"] in ("prefill", "decode", "idle")}
    assert kinds[step] == "idle", kinds
    for rank in (0, 1):
        replayed = {r["step_id"] for r in graph_records(run_dir, "replay", rank)}
        assert step not in replayed and {step - 1, step + 1} <= replayed, (rank, sorted(replayed))
    found, text = _found(run_dir)
    assert found == [("graph_mode_demoted", idle, step, (idle,))], text


def test_rank_graph_mode_is_named_at_the_rank_under_pcp(tmp_path):
    """PCP=2, a tiny DeepSeek-V2 (MLA), one request whose decode steps replay graphs: rank 0
    runs step 3 eager in one run, rank 1 step 5 in the other, while the peer replays. Replay of
    the stripped logs names `replica_divergence` at that step and rank alone ("decided graph=0"),
    and nothing else; the eager rank logged no replay at that step, its peer did. Fails with
    `_eager_beside_a_replay` left out (both ranks named, no majority) and on a worker without
    the fault (sound)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_vllm_mla_pcp import NEW_TOKENS, PROMPTS as ALL_PROMPTS

    from runner_fsm.testing.vllm_models import make_model

    prompts = {"long": ALL_PROMPTS["long"]}  # one request: under PCP vLLM replays its decode steps
    model = make_model(tmp_path / "deepseek_v2", "deepseek_v2", seed=3)
    faults = {"rank0": (0, 3), "rank1": (1, 5)}  # run -> (rank, step)
    runs = [{"name": name, "pcp": 2, "run_dir": str(tmp_path / name), "llm": GRAPHS,
             "options": {"inject": f"rank-graph-mode@replica=0,step={step},rank={rank}"}}
            for name, (rank, step) in faults.items()]
    spec = {"model": model, "prompts": prompts, "new_tokens": NEW_TOKENS, "runs": runs}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    child = subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_mla_child.py"), json.dumps(spec)],
                           capture_output=True, text=True, env=env, timeout=1200)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-4000:]
    for name, (rank, step) in faults.items():
        run_dir = tmp_path / name
        for r in (0, 1):
            replayed = {rec["step_id"] for rec in graph_records(run_dir, "replay", r)}
            assert (step in replayed) == (r != rank) and {step - 1, step + 1} <= replayed, (name, r, sorted(replayed))
        found, text = _found(run_dir)
        assert found == [("replica_divergence", 0, step, (rank,))], text
        assert "decided graph=0" in text, text
