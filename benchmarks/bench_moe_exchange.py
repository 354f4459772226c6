"""Bytes the expert exchange moves per step: routed all-to-all vs the all-gather, same run.

The engine on the demo workload (12 requests, `bench_engine`'s) at DP=2 x PCP=2, four
processes, no drafting, twice per repeat, interleaved: with the routed exchange (the default:
counts in the header, `all_to_all_single` to the experts' owners and back; padding and
PCP-replicated copies send nothing) and with the all-gather exchange it replaced (every rank's
padded rows to every rank, one all_reduce of the results), selected in the child process by
`MixtralDecoder.exchange`. Bytes are what each rank logged with its forwards (`exchange_bytes`
of the `forward` collective's done record: bytes it sent to other ranks, the all_reduce counted
as a ring, 2 (w-1)/w of its tensor), summed over the four ranks per step. Outputs must be equal
between the two before anything is reported.

    .venv/bin/python benchmarks/bench_moe_exchange.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from common import Row, Spread
from bench_engine import _requests

MODES = ("routed", "gathered")


def _config(root: str, mode: str, rep: int):
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.config import EngineConfig

    return EngineConfig(model_dir=f"{root}/model", layout=ParallelLayout(2, 2),
                        run_dir=f"{root}/runs/{mode}-{rep}", run_id=f"exchange-{mode}-{rep}")


def _rank_main(groups, root: str, repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from runner_fsm.engine.worker import run_rank
    from runner_fsm.model.decoder import MixtralDecoder

    torch.set_num_threads(1)
    requests = _requests(f"{root}/model")
    out = []
    for rep in range(repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            MixtralDecoder.exchange = mode  # this process's models only (a benchmark switch)
            dist.barrier(group=groups.world)
            result = run_rank(groups, _config(root, mode, rep), requests)
            if result.error is not None:
                raise RuntimeError(f"{mode} rep {rep}: rank {result.global_rank} failed: {result.error}")
            out.append({"mode": mode, "rep": rep, "outputs": result.outputs, "elapsed_s": result.elapsed_s,
                        "pcp_rank": result.pcp_rank})
    return out


def bytes_per_step(run_dir: Path) -> dict[int, dict[str, int]]:
    """step -> summed bytes sent and bytes an all-gather would send (the `exchange` field:
    [mode, sent, all-gather, layers]) of every rank's target forwards."""
    from runner_fsm.audit import read_records

    steps: dict[int, dict[str, int]] = {}
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        for rec in read_records(path):
            if rec.get("event") == "collective" and rec.get("op") == "forward" and rec.get("stage") == "done":
                entry = steps.setdefault(rec["step_id"], {"sent": 0, "allgather": 0})
                entry["sent"] += rec["exchange"][1]
                entry["allgather"] += rec["exchange"][2]
    return steps


def measure(repeats: int = 2) -> dict:
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.launch import spawn
    from runner_fsm.model import TARGET_SPEC, make_random_model

    res = {mode: {"tps": [], "bytes": [], "computed_allgather": [], "outputs": []} for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-exchange-") as root:
        make_random_model(f"{root}/model", TARGET_SPEC, seed=0)
        ranks = spawn(_rank_main, ParallelLayout(2, 2), root, repeats, timeout_s=500)
        for i in range(len(ranks[0])):
            runs = [r[i] for r in ranks]
            mode, rep = runs[0]["mode"], runs[0]["rep"]
            outputs = {}
            for run in runs:
                if run["pcp_rank"] == 0:
                    outputs.update(run["outputs"])
            steps = bytes_per_step(Path(root) / "runs" / f"{mode}-{rep}")
            entry = res[mode]
            entry["tps"].append(sum(len(t) for t in outputs.values()) / max(r["elapsed_s"] for r in runs))
            entry["bytes"].append(statistics.mean(s["sent"] for s in steps.values()))
            entry["computed_allgather"].append(statistics.mean(s["allgather"] for s in steps.values()))
            entry["outputs"].append(outputs)
    return res


def rows(quick: bool = False) -> list[Row]:
    res = measure(repeats=2)
    reference = res["gathered"]["outputs"][0]
    assert len(reference) == 12, "outputs incomplete"
    for mode in MODES:
        for outputs in res[mode]["outputs"]:
            assert outputs == reference, f"{mode}: outputs differ from the all-gather run"
    routed, gathered = res["routed"], res["gathered"]
    # The routed run's logged "what the all-gather would send" must be what the all-gather sent.
    assert routed["computed_allgather"][0] == gathered["bytes"][0], (routed["computed_allgather"], gathered["bytes"])
    b_routed, b_gathered = Spread.of(routed["bytes"]), Spread.of(gathered["bytes"])
    t_routed, t_gathered = Spread.of(routed["tps"]), Spread.of(gathered["tps"])
    speed = Spread.of([a / b for a, b in zip(routed["tps"], gathered["tps"])])
    return [
        Row("expert exchange bytes/step, DP=2xPCP=2 (4 ranks summed)", b_routed.fmt(" KB", 1e-3),
            f"all-gather {b_gathered.fmt(' KB', 1e-3)}", f"{b_gathered.median / b_routed.median:.2f}x less",
            "report", "report",
            note="demo workload, no drafting; bytes each rank sent to others, from the audit log's forward records;"
                 " outputs equal"),
        Row("engine DP=2xPCP=2 tokens/s, routed exchange", t_routed.fmt(" tok/s"),
            f"all-gather {t_gathered.fmt(' tok/s')}", f"{speed.median:.2f}x", "report", "report",
            note="same run, interleaved; 4 procs x 1 thread"),
    ]


def main() -> int:
    from common import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
