"""DP agreement latency: `runner_fsm.dp.sync` against a bare `all_reduce` of the same tensor.

Four processes (`runner_fsm.engine.launch.spawn`, DP=4 x PCP=1, gloo on 127.0.0.1). In each
iteration every rank runs one `sync` (pack its column, all_reduce(SUM) the int64 [7, 4]
tensor, apply the agreement rule) and one bare `dist.all_reduce` of a preallocated int64
[7, 4] tensor, in alternating order, each timed on its own. Per block of iterations the
figure is the median over ranks and iterations; the block medians give the spread.
Before timing, every rank checks that `sync` returns the agreement of all four columns.

    .venv/bin/python benchmarks/bench_dp_sync.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from common import Row, Spread, time_calls, verdict

NUM_PROCS = 4


def _rank_main(groups, iterations: int, blocks: int) -> dict:
    import torch
    import torch.distributed as dist

    from runner_fsm import dp

    group, rank, size = groups.dp, groups.dp_rank, groups.layout.dp_size
    # Correct first: every rank gets every column, agreed as the pure rule would.
    local = dp.LocalDispatch(step_id=5, phase=dp.TARGET, num_tokens=10 + rank, num_reqs=rank + 1)
    got = dp.sync(group, local)
    expected = dp.agree([dp.LocalDispatch(5, dp.TARGET, num_tokens=10 + r, num_reqs=r + 1) for r in range(size)])
    assert got == expected, f"rank {rank}: sync gave {got}, the rule gives {expected}"

    bare = torch.zeros((len(dp.ROWS), size), dtype=torch.int64)
    clock = time.perf_counter
    per_block = {"sync": [], "bare": []}
    for warm in (True, False):
        for _block in range(1 if warm else blocks):
            samples = {"sync": [], "bare": []}
            for i in range(iterations // (4 if warm else 1)):
                local = dp.LocalDispatch(step_id=i, phase=dp.TARGET, num_tokens=8, num_reqs=1)
                for kind in (("sync", "bare") if i % 2 == 0 else ("bare", "sync")):
                    start = clock()
                    if kind == "sync":
                        dp.sync(group, local)
                    else:
                        dist.all_reduce(bare, op=dist.ReduceOp.SUM, group=group)
                    samples[kind].append(clock() - start)
            if not warm:
                for kind, values in samples.items():
                    per_block[kind].append(values)
    return per_block


def measure(iterations: int = 150, blocks: int = 5) -> dict[str, list[float]]:
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.launch import spawn

    results = spawn(_rank_main, ParallelLayout(NUM_PROCS, 1), iterations, blocks, timeout_s=240)
    # Per block: the median over every rank's samples (ranks wait for each other anyway).
    out = {}
    for kind in ("sync", "bare"):
        out[kind] = [statistics.median([x for r in results for x in r[kind][b]]) for b in range(blocks)]
    return out


def own_work_us(repeats: int = 5, number: int = 2000) -> Spread:
    """What `sync` adds around the collective, in this process: pack a column, read the
    summed tensor back, apply the rule (the all_reduce replaced by a ready-made sum)."""
    from runner_fsm import dp

    columns = [dp.LocalDispatch(7, dp.TARGET, num_tokens=8 + r, num_reqs=1) for r in range(NUM_PROCS)]
    summed = sum(dp.pack(c, r, NUM_PROCS) for r, c in enumerate(columns))
    rule = getattr(dp, "_agree_rows", None)
    expected = dp.agree(columns)

    def work():
        dp.pack(columns[0], 0, NUM_PROCS)
        rows = summed.tolist()
        return rule(rows, ()) if rule is not None else dp.agree(dp.unpack(rows))

    assert work() == expected, "the rule over the summed columns must give the agreement"
    return Spread.of([t * 1e6 for t in time_calls(work, repeats=repeats, number=number)])


def rows(quick: bool = False) -> list[Row]:
    times = measure(iterations=100 if quick else 150)
    sync, bare = Spread.of(times["sync"]), Spread.of(times["bare"])
    ratio = Spread.of([s / b for s, b in zip(times["sync"], times["bare"])])
    own = own_work_us()
    return [Row(
        f"DP agreement, {NUM_PROCS} procs gloo", f"sync {sync.fmt(' us', 1e6)}",
        f"bare all_reduce {bare.fmt(' us', 1e6)}", f"{ratio.median:.2f}x [{ratio.low:.2f}-{ratio.high:.2f}]",
        "<= 1.2x", verdict(ratio.median <= 1.2),
        note=(f"sync's own work around the collective (pack, read back, rule), timed in one process:"
              f" {own.fmt(' us')}; the all_reduce itself is slow here because {NUM_PROCS} processes"
              f" share {os.cpu_count()} cores"))]


def main() -> int:
    from common import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
