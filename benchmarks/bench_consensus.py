"""What a replica agreeing with itself costs (Part 20): the online `consensus` check per step on
2 ranks, and the bytes the decision digests add to the audit log per step and rank.

- consensus: two processes (`runner_fsm.engine.launch.spawn`, DP=1 x PCP=2, gloo on
  127.0.0.1), each running what `Replica._check_consensus` runs every step (its row, the
  exchange of the rows among the replica's ranks: shared memory, as the ranks share this host,
  `shm_exchange`; the rule), timed per call; before timing, a row that differs must be named.
  The baseline is a bare gloo `all_gather` of the same tensor in the same loop (alternating
  order): what the check cost when it went over gloo.
- bytes: a real embedded run (tiny Mixtral, DP=2 x PCP=2, K=1, graphs: `real_logs`); per
  step and rank, the bytes of each `finish` record less the same record without `dg`/`dc`.

    .venv/bin/python benchmarks/bench_consensus.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Row, Spread, time_calls, verdict

TARGET_US = 50.0


def _rank_main(groups, iterations: int, blocks: int) -> dict:
    import torch
    import torch.distributed as dist

    from runner_fsm.audit.decisions import StepDecisions
    from runner_fsm.agree.shm_exchange import ShmExchange, replica_exchange
    from runner_fsm.agree.consensus import consensus_row, disagreement

    group, rank = groups.pcp, groups.pcp_rank
    gather_rows = replica_exchange(group, 8, timeout_s=60)  # what `Replica._check_consensus` makes
    assert isinstance(gather_rows, ShmExchange)  # the ranks share this host
    odd = StepDecisions(True, 9, 4, 8, 8 if rank == 0 else 0, 1, 5)  # rank 1 eager: named
    assert "decided graph=0" in (disagreement(gather_rows(consensus_row(3, odd)), 3) or "")
    decided = StepDecisions(True, 123456789, 4, 8, 8, 1, 987654321)
    bare = torch.zeros(8, dtype=torch.int64)
    parts = [torch.empty_like(bare) for _ in range(2)]
    clock = time.perf_counter
    per_block: dict[str, list] = {"consensus": [], "bare": []}
    for warm in (True, False):
        for _ in range(1 if warm else blocks):
            samples: dict[str, list] = {"consensus": [], "bare": []}
            for i in range(iterations // (4 if warm else 1)):
                for kind in (("consensus", "bare") if i % 2 == 0 else ("bare", "consensus")):
                    start = clock()
                    if kind == "consensus":
                        assert disagreement(gather_rows(consensus_row(i, decided)), i) is None
                    else:
                        dist.all_gather(parts, bare, group=group)
                    samples[kind].append(clock() - start)
            if not warm:
                for kind, values in samples.items():
                    per_block[kind].append(statistics.median(values))
    return per_block


def consensus_us(iterations: int, blocks: int = 5) -> dict[str, list[float]]:
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.launch import spawn

    results = spawn(_rank_main, ParallelLayout(1, 2), iterations, blocks, timeout_s=240)
    return {kind: [max(r[kind][b] for r in results) * 1e6 for b in range(blocks)] for kind in ("consensus", "bare")}


def own_work_us(repeats: int = 5, number: int = 2000) -> Spread:
    """What the check adds around the all_gather, in one process: the row, filling the tensor,
    reading the gathered rows back, the rule (the all_gather replaced by rows made already)."""
    import torch

    from runner_fsm.audit.decisions import StepDecisions
    from runner_fsm.agree.consensus import consensus_row, disagreement

    decided = StepDecisions(True, 123456789, 4, 8, 8, 1, 987654321)
    mine = torch.zeros(8, dtype=torch.int64)
    view, parts = mine.numpy(), [mine.numpy(), mine.numpy()]

    def work():
        view[:] = consensus_row(7, decided)
        return disagreement([part.tolist() for part in parts], 7)

    assert work() is None
    return Spread.of([t * 1e6 for t in time_calls(work, repeats=repeats, number=number)])


def digest_bytes() -> tuple[float, float, int, int]:
    """(mean bytes the digests add to a step of a rank, the mean on steps where no decision
    changed (the digest alone), steps counted, steps with changed decisions) in a real
    embedded run."""
    import orjson
    from real_logs import write_real_run

    added, alone = [], []
    with tempfile.TemporaryDirectory(prefix="bench-consensus-") as base:
        run = Path(base) / "run"
        write_real_run(run, dp=2, pcp=2, requests=12)
        for path in sorted(run.glob("rank-*.jsonl")):
            for line in path.read_bytes().splitlines()[1:]:
                record = orjson.loads(line)
                if "dg" in record:
                    added.append(len(line) - len(orjson.dumps({k: v for k, v in record.items()
                                                                if k not in ("dg", "dc")})))
                    if "dc" not in record:
                        alone.append(added[-1])
    return statistics.mean(added), statistics.mean(alone) if alone else 0.0, len(added), len(added) - len(alone)


def rows(quick: bool = False) -> list[Row]:
    times = consensus_us(iterations=200 if quick else 400)
    check, bare = Spread.of(times["consensus"]), Spread.of(times["bare"])
    own = own_work_us()
    mean, alone, steps, changed = digest_bytes()
    return [
        Row("online consensus per step, 2 ranks", f"{check.fmt(' us')}", f"bare gloo all_gather {bare.fmt(' us')}",
            f"{check.median / bare.median:.2f}x", f"<= {TARGET_US:.0f} us", verdict(check.median <= TARGET_US),
            note="Replica._check_consensus's work (row, exchange of int64[8] among the replica's ranks through"
                 " shared memory, rule; gloo where they do not share a host);"
                 f" per block the slower rank's median; its own work around the all_gather, in one process:"
                 f" {own.fmt(' us')}; opt-in (`consensus`), off by default"),
        Row("decision digest bytes per step and rank", f"{mean:.1f} B mean",
            f"digest alone (no decision changed): {alone:.1f} B", "-", "report", "report",
            note=f"`dg` on each `finish`, plus `dc` (the decisions that changed) where one did ({changed} of"
                 f" {steps} steps over its ranks: short requests join and leave the batch almost every step);"
                 " real embedded DP=2 x PCP=2 run, K=1, graphs"),
    ]


def main() -> int:
    from common import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
