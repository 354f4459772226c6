"""Shared pieces of the benchmarks: repeated timing, medians with their spread, table rows.

A figure is always the median of repeated measurements, printed with its min and max. A
row compares a figure with a baseline measured in the same run; the ratio and the target
decide pass/miss. Benchmarks never fail CI: a miss is reported, not raised. What *is*
raised is a wrong output: every benchmark checks its result before it times anything.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Spread:
    """Median, min and max of repeated measurements of one figure."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
        m, lo, hi = self.median * scale, self.low * scale, self.high * scale
        return f"{_num(m, digits)}{unit} [{_num(lo, digits)}-{_num(hi, digits)}]"


def _num(value: float, digits: int) -> str:
    if value == 0:
        return "0"
    mag = abs(value)
    if mag >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: figure vs a baseline measured in the same run."""

    name: str
    figure: str  # e.g. "1.23 ms [1.1-1.4]"
    baseline: str
    ratio: str  # e.g. "42.0x faster"
    target: str  # e.g. ">= 10x"
    status: str  # "pass", "miss" or "report"
    note: str = ""


def verdict(ok: bool | None) -> str:
    return "report" if ok is None else ("pass" if ok else "miss")


def time_calls(fn: Callable[[], object], *, repeats: int, number: int = 1,
               warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `repeats` times, each the mean of `number` back-to-back calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - start) / number)
    return out


def interleaved(fns: dict[str, Callable[[], object]], *, repeats: int, number: int = 1,
                warmup: int = 1) -> dict[str, list[float]]:
    """Like `time_calls` for several functions, alternated repeat by repeat (same noise)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(repeats):
        # Alternate the order too, so neither always runs right after the other.
        for name in names if rep % 2 == 0 else names[::-1]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            out[name].append((time.perf_counter() - start) / number)
    return out


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table (also readable as plain text)."""
    head = ("benchmark", "figure (median [min-max])", "baseline, same run", "ratio", "target", "result")
    body = [(r.name, r.figure, r.baseline, r.ratio, r.target, r.status) for r in rows]
    widths = [max(len(str(line[i])) for line in [head, *body]) for i in range(len(head))]

    def line(cells) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = [line(head), sep, *(line(b) for b in body)]
    notes = [f"- {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        out += ["", *notes]
    return "\n".join(out)
