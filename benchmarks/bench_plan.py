"""PCP planning: speed against a per-request Python baseline, scaling, and padding waste.

- speed: `plan_batch` on a mixed batch of 512 requests (1/4 prefills of 1-8192 tokens, half
  of them fresh and half continuing a chunked prefill; the rest decodes, 1 in 8 a verify row
  of 1+2 tokens) against `naive_plan.naive_plan` (same rules, "ceil", plain Python), for
  P = 2, 4, 8; both outputs are compared value by value before anything is timed.
- scaling: `plan_batch` from 64 to 4096 requests, on batches that repeat one 64-request
  batch, so tokens grow exactly with requests: linear cost means flat time per request.
- padding waste: over batches a chunked-prefill scheduler would form from lognormal prompt
  lengths (median 256 tokens, sigma 1.2, at most 8192) plus decodes, under a 2048-token
  budget: waste = P*N / sum_r n_r - 1, the share of executed rows that are padding, for
  "ceil" (the baseline, vLLM's) and "balanced"; balanced must never be wider.

    .venv/bin/python benchmarks/bench_plan.py
"""

from __future__ import annotations

import sys

import numpy as np

from common import Row, Spread, interleaved, verdict
from naive_plan import assert_same_plan, naive_plan
from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

MAX_PREFILL = 8192


def mixed_batch(num_reqs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_scheduled, is_prefilling, num_computed) of the benchmark's mixed batch."""
    rng = np.random.default_rng(seed)
    prefilling = np.zeros(num_reqs, dtype=bool)
    prefilling[rng.choice(num_reqs, num_reqs // 4, replace=False)] = True
    decode_len = np.where(rng.random(num_reqs) < 1 / 8, 3, 1)
    scheduled = np.where(prefilling, rng.integers(1, MAX_PREFILL + 1, num_reqs), decode_len)
    continuing = rng.random(num_reqs) < 0.5
    computed = rng.integers(1, MAX_PREFILL + 1, num_reqs)
    computed = np.where(prefilling & ~continuing, 0, computed)
    return scheduled.astype(np.int64), prefilling, computed.astype(np.int64)


def speed_rows(num_reqs: int = 512, pcp_sizes=(2, 4, 8), repeats: int = 5) -> list[Row]:
    batch = mixed_batch(num_reqs)
    lists = tuple(a.tolist() for a in batch)  # the baseline's natural input: Python lists
    rows = []
    for p in pcp_sizes:
        assert_same_plan(plan_batch(*batch, p), naive_plan(*lists, p))
        times = interleaved({  # every rank's rows built, as the baseline builds them
            "vectorised": lambda: tuple(plan_batch(*batch, p).ranks),
            "naive": lambda: naive_plan(*lists, p),
        }, repeats=repeats)
        fast, slow = Spread.of(times["vectorised"]), Spread.of(times["naive"])
        ratio = Spread.of([b / a for a, b in zip(times["vectorised"], times["naive"])])
        rows.append(Row(
            f"PCP plan, {num_reqs} reqs, P={p}", fast.fmt(" ms", 1e3), f"per-request Python {slow.fmt(' ms', 1e3)}",
            f"{ratio.median:.1f}x faster", ">= 10x", verdict(ratio.median >= 10),
            note=f"{int(batch[0].sum()):,} tokens" if p == pcp_sizes[0] else ""))
    return rows


def scaling_row(sizes=(64, 256, 1024, 4096), pcp_size: int = 4, repeats: int = 5) -> Row:
    base = mixed_batch(sizes[0], seed=1)
    calls = {}
    for n in sizes:
        sched, pre, comp = (np.tile(a, n // sizes[0]) for a in base)
        plan = plan_batch(sched, pre, comp, pcp_size)
        assert plan.num_tokens == int(sched.sum()), "plan lost tokens"
        calls[n] = (lambda s=sched, p=pre, c=comp: tuple(plan_batch(s, p, c, pcp_size).ranks))
    # Sizes interleaved, each repeat timing ~the same number of tokens (small sizes: several calls).
    fns = {n: (lambda f=f, k=max(1, sizes[-1] // n // 4): [f() for _ in range(k)]) for n, f in calls.items()}
    times = interleaved(fns, repeats=repeats)
    per_req = {n: Spread.of([t / max(1, sizes[-1] // n // 4) / n for t in times[n]]) for n in sizes}
    lo, hi = sizes[0], sizes[-1]
    growth = per_req[hi].median / per_req[lo].median
    detail = ", ".join(f"{n}: {per_req[n].median * 1e6:.1f}" for n in sizes)
    return Row(
        f"PCP plan scaling {lo}->{hi} reqs, P={pcp_size}", f"{per_req[hi].fmt(' us/req', 1e6)} at {hi}",
        f"{per_req[lo].fmt(' us/req', 1e6)} at {lo}",
        f"{growth:.2f}x per-req cost", "<= 2x (linear)", verdict(growth <= 2.0),
        note=f"time per request (us) by batch size: {detail}; {int(base[0].sum()) // sizes[0]:,} tokens/request")


def scheduler_batches(num_batches: int, seed: int, budget: int = 2048) -> list[tuple]:
    """Batches of a chunked-prefill scheduler: decodes first, then prompt chunks to the budget."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_batches):
        decodes = int(rng.integers(0, 33))
        prompts = np.clip(np.round(rng.lognormal(np.log(256), 1.2, int(rng.integers(1, 9)))), 1, MAX_PREFILL)
        scheduled, computed, left = [1] * decodes, list(rng.integers(1, 4096, decodes)), budget - decodes
        prefilling = [False] * decodes
        for length in prompts.astype(int).tolist():
            if left <= 0:
                break
            done = int(rng.integers(0, length)) if rng.random() < 0.2 else 0  # a continued chunk
            chunk = min(length - done, left)
            scheduled.append(chunk)
            computed.append(done)
            prefilling.append(True)
            left -= chunk
        out.append((np.array(scheduled), np.array(prefilling), np.array(computed)))
    return out


def waste_rows(pcp_sizes=(2, 4, 8), seeds=(0, 1, 2, 3), num_batches: int = 250) -> list[Row]:
    rows = []
    for p in pcp_sizes:
        waste = {"ceil": [], "balanced": []}
        worse, better = 0, 0
        for seed in seeds:
            padded = {"ceil": 0, "balanced": 0}
            executed = {"ceil": 0, "balanced": 0}
            for sched, pre, comp in scheduler_batches(num_batches, seed):
                widths = {}
                for policy in waste:
                    plan = plan_batch(sched, pre, comp, p, chunking=policy)
                    n = plan.num_tokens_padded
                    assert n == num_tokens_for_dispatch(sched, pre, p, chunking=policy)
                    assert sum(plan.per_rank_num_tokens) == int(sched[~pre].sum()) * p + int(sched[pre].sum())
                    padded[policy] += p * n
                    executed[policy] += sum(plan.per_rank_num_tokens)
                    widths[policy] = n
                bound = int(sched[~pre].sum()) + -(-int(sched[pre].sum()) // p)
                assert widths["balanced"] == bound, "balanced must meet its lower bound D + ceil(S/P)"
                worse += widths["balanced"] > widths["ceil"]
                better += widths["balanced"] < widths["ceil"]
            for policy in waste:
                waste[policy].append(padded[policy] / executed[policy] - 1)
        bal, ceil = Spread.of(waste["balanced"]), Spread.of(waste["ceil"])
        total = num_batches * len(seeds)
        rows.append(Row(
            f"padding waste, P={p}", f"balanced {bal.fmt('%', 100, 2)}", f"ceil {ceil.fmt('%', 100, 2)}",
            f"{bal.median / ceil.median:.2f}x" if ceil.median else "-", "balanced never worse",
            verdict(worse == 0),
            note=f"{total} scheduler batches; balanced narrower in {better}, wider in {worse}"))
    return rows


def rows(quick: bool = False) -> list[Row]:
    reps = 3 if quick else 5
    return [*speed_rows(repeats=reps), scaling_row(repeats=reps), *waste_rows()]


def main() -> int:
    from common import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
