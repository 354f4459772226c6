"""End-to-end tokens/s of the embedded engine on the demo workload.

The workload of `runner-fsm demo`: 12 synthetic requests (seed 7, prompts of 4-80 tokens,
10 new tokens each, one arriving per step) on the tiny target model (TARGET_SPEC, seed 0).
Configurations:
- DP=1 x PCP=1, no drafting: the baseline (one process, torch's default threads, as
  `run_engine` runs a 1x1 layout in-process);
- DP=2 x PCP=2 (four processes, one thread each), no drafting;
- drafting with K=2 on both layouts, with the draft of `make-model --draft` (DRAFT_SPEC), and
  with a draft that is a byte-identical copy of the target (every draft accepted: what
  drafting buys when drafts are good).
Each layout is one `spawn` job whose ranks call `engine.worker.run_rank` (the engine's own
rank entry) once per configuration and repeat, interleaved; tokens/s is generated tokens
over the slowest rank's `elapsed_s`, as `runner-fsm run` reports it (model load included).
Every configuration's outputs must equal the baseline's before any figure is reported.

    .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import filecmp
import json
import os
import sys
import tempfile
from pathlib import Path

from common import Row, Spread

SPEC_TOKENS = 2
DRAFTS = ("none", "draft", "copy")  # no drafting, DRAFT_SPEC, a copy of the target


def _requests(model_dir: str):
    from runner_fsm.engine.requests import synthetic_requests

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return synthetic_requests(12, vocab_size=vocab, seed=7, max_new_tokens=10, max_prompt=80,
                              arrival_every=1)


def _config(root: str, dp: int, pcp: int, draft: str, rep: int):
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.config import EngineConfig

    draft_dir = {"none": None, "draft": f"{root}/draft", "copy": f"{root}/copy"}[draft]
    return EngineConfig(model_dir=f"{root}/model", draft_dir=draft_dir, layout=ParallelLayout(dp, pcp),
                        num_speculative_tokens=0 if draft == "none" else SPEC_TOKENS,
                        run_dir=f"{root}/runs/dp{dp}-pcp{pcp}-{draft}-{rep}", run_id=f"bench-{draft}-{rep}")


def _rank_main(groups, root: str, dp: int, pcp: int, repeats: int, threads: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from runner_fsm.engine.worker import run_rank

    torch.set_num_threads(threads)
    blocked = _time_collectives(dist)
    requests = _requests(f"{root}/model")
    out = []
    for rep in range(repeats):
        order = DRAFTS if rep % 2 == 0 else DRAFTS[::-1]
        for draft in order:
            cfg = _config(root, dp, pcp, draft, rep)
            dist.barrier(group=groups.world)  # every rank starts together
            blocked.clear()
            result = run_rank(groups if dp * pcp > 1 else None, cfg, requests)
            if result.error is not None:
                raise RuntimeError(f"{draft} rep {rep}: rank {result.global_rank} failed: {result.error}")
            out.append({"draft": draft, "rep": rep, "outputs": result.outputs, "elapsed_s": result.elapsed_s,
                        "pcp_rank": result.pcp_rank, "num_steps": result.num_steps,
                        "collective_s": sum(blocked), "collectives": len(blocked)})
    return out


def _time_collectives(dist) -> list[float]:
    """Seconds spent inside every gloo all_gather / all_reduce of this process (the model's
    K/V, header and expert exchanges, the restore, the DP agreement), waiting for peers
    included: a profile of where a multi-process step goes."""
    import time

    spent: list[float] = []
    for name in ("all_gather", "all_reduce"):
        inner = getattr(dist, name)

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(dist, name, timed)
    return spent


def _prepare(root: str) -> None:
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    make_random_model(f"{root}/model", TARGET_SPEC, seed=0)
    make_random_model(f"{root}/draft", DRAFT_SPEC, seed=0)  # as `runner-fsm demo` writes it
    make_random_model(f"{root}/copy", TARGET_SPEC, seed=0)
    same = filecmp.cmpfiles(f"{root}/model", f"{root}/copy", os.listdir(f"{root}/model"), shallow=False)
    assert not same[1] and not same[2], f"the copied draft differs from the target: {same[1:]}"


def measure(repeats: int = 3) -> dict:
    """Per (layout, draft): tokens/s per repeat, steps, and the merged outputs."""
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.launch import spawn

    layouts = {(1, 1): os.cpu_count() or 1, (2, 2): 1}  # threads per process
    res: dict = {"threads": layouts}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as root:
        _prepare(root)
        for (dp, pcp), threads in layouts.items():
            ranks = spawn(_rank_main, ParallelLayout(dp, pcp), root, dp, pcp, repeats, threads, timeout_s=400)
            for i in range(len(ranks[0])):
                runs = [r[i] for r in ranks]
                outputs = {}
                for run in runs:
                    if run["pcp_rank"] == 0:
                        outputs.update(run["outputs"])
                tokens = sum(len(t) for t in outputs.values())
                elapsed = max(run["elapsed_s"] for run in runs)
                entry = res.setdefault((dp, pcp, runs[0]["draft"]),
                                       {"tps": [], "steps": [], "outputs": [], "blocked": [], "calls": []})
                entry["tps"].append(tokens / elapsed)
                entry["steps"].append(max(run["num_steps"] for run in runs))
                entry["blocked"].append(sum(run["collective_s"] / run["elapsed_s"] for run in runs) / len(runs))
                entry["calls"].append(sum(run["collectives"] for run in runs) / len(runs))
                entry["outputs"].append(outputs)
    return res


def rows(quick: bool = False) -> list[Row]:
    res = measure(repeats=2 if quick else 3)
    res_threads = res.pop("threads")
    reference = res[(1, 1, "none")]["outputs"][0]
    assert len(reference) == 12 and all(len(t) == 10 for t in reference.values()), "baseline outputs incomplete"
    for key, entry in res.items():
        for outputs in entry["outputs"]:
            differ = sorted(r for r in set(outputs) | set(reference) if outputs.get(r) != reference.get(r))
            assert not differ, f"DP={key[0]} x PCP={key[1]}, draft={key[2]}: outputs differ for {differ}"
    base = Spread.of(res[(1, 1, "none")]["tps"])
    label = {"none": "no drafting", "draft": f"K={SPEC_TOKENS} DRAFT_SPEC draft", "copy": f"K={SPEC_TOKENS} target-copy draft"}
    out = []
    for (dp, pcp, draft), entry in res.items():
        tps = Spread.of(entry["tps"])
        steps = Spread.of(entry["steps"]).median
        if (dp, pcp, draft) == (1, 1, "none"):
            baseline, ratio = "(this is the baseline)", "1.00x"
        else:
            # Against the baseline, and for drafting also against the same layout without it.
            vs_base = Spread.of([a / b for a, b in zip(entry["tps"], res[(1, 1, "none")]["tps"])])
            baseline = f"DP=1xPCP=1, no drafting {base.fmt(' tok/s')}"
            ratio = f"{vs_base.median:.2f}x"
            if draft != "none":
                same = Spread.of([a / b for a, b in zip(entry["tps"], res[(dp, pcp, 'none')]['tps'])])
                ratio += f" ({same.median:.2f}x vs no draft)"
        note = f"{steps:.0f} engine steps; outputs equal to the baseline"
        if dp * pcp > 1:
            blocked, calls = Spread.of(entry["blocked"]).median, Spread.of(entry["calls"]).median
            note += (f"; {calls / steps:.0f} gloo collectives per step per rank, {blocked:.0%} of each"
                     f" rank's time blocked in them (peers' compute included)")
        procs = f"{dp * pcp} proc{'s' if dp * pcp > 1 else ''} x {res_threads[(dp, pcp)]} thr"
        out.append(Row(f"engine DP={dp}xPCP={pcp} ({procs}), {label[draft]}", tps.fmt(" tok/s"), baseline, ratio,
                       "report", "report", note=note))
    return out


def main() -> int:
    from common import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
