"""Which steps a replay judged, and which it did not: a window (`--last N`, `--steps A:B`) and
the steps a capped log rotated away (`ranklog`).

A replay only speaks for the steps it read. The report says which those are, and never calls
steps sound that it did not see: steps outside the window are not judged, and steps some rank
no longer holds are judged among the ranks that still hold them, or not at all.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Rotated:
    """Steps first..last that these ranks' logs no longer hold."""

    first: int
    last: int
    ranks: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "ranks": list(self.ranks)}


def rotated_spans(per_rank: Iterable[tuple[int, tuple[tuple[int, int], ...]]]) -> tuple[Rotated, ...]:
    """The rotated-away ranges of every rank, one entry per range with the ranks that lost it."""
    by_span: dict[tuple[int, int], list[int]] = {}
    for rank, spans in per_rank:
        for span in spans:
            by_span.setdefault(span, []).append(rank)
    return tuple(Rotated(first, last, tuple(sorted(ranks))) for (first, last), ranks in sorted(by_span.items()))


def parse_steps(text: str) -> tuple[int, int]:
    """'A:B' (both included) as (A, B); ValueError otherwise."""
    match = re.fullmatch(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*", text)
    if match is None or int(match[1]) > int(match[2]):
        raise ValueError(f"expected --steps A:B with A <= B (both included), got {text!r}")
    return int(match[1]), int(match[2])


def resolve_window(last_step: int | None, *, steps: tuple[int, int] | None = None,
                   last: int | None = None) -> tuple[int, int] | None:
    """The steps to judge (both included): `steps` as given, or the `last` N up to `last_step`
    (the last step any rank's log holds); None: every step."""
    if steps is not None:
        return steps
    if last is not None:
        if last < 1:
            raise ValueError(f"--last needs a positive number of steps, got {last}")
        end = last_step if last_step is not None else 0
        return end - last + 1, end
    return None


def _ranks(ranks: tuple[int, ...], total: int) -> str:
    if len(ranks) == total:
        return "every rank"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def coverage_lines(window: tuple[int, int] | None, logs: tuple[int, int] | None,
                   rotated: tuple[Rotated, ...], ranks: int) -> list[str]:
    """What the report says of the steps it did not judge, one line each."""
    lines = []
    if window is not None:
        outside = []
        if logs is not None and logs[0] < window[0]:
            outside.append(f"{logs[0]}..{window[0] - 1}")
        if logs is not None and logs[1] > window[1]:
            outside.append(f"{window[1] + 1}..{logs[1]}")
        rest = f"; steps {' and '.join(outside)} of the logs not judged" if outside else ""
        lines.append(f"window: steps {window[0]}..{window[1]} judged{rest}")
    for span in rotated:
        if window is not None and (span.last < window[0] or span.first > window[1]):
            continue
        lines.append(f"rotated away: steps {span.first}..{span.last} on {_ranks(span.ranks, ranks)} (capped log):"
                     " not judged there")
    shared = _shared_from(rotated, ranks)
    if shared is not None and any(span.last + 1 < shared for span in rotated):
        lines.append(f"every rank holds steps from {shared} on; the steps before, each judged among the ranks"
                     " that still hold it")
    return lines


def _shared_from(rotated: tuple[Rotated, ...], ranks: int) -> int | None:
    """The first step after which no rank's log lost any (when every rank lost the run's start)."""
    firsts: dict[int, int] = {}
    for span in rotated:
        if span.first <= 0:
            for rank in span.ranks:
                firsts[rank] = max(firsts.get(rank, 0), span.last + 1)
    return max(firsts.values()) if firsts and len(firsts) == ranks else None


def sound_line(window: tuple[int, int] | None, first: int | None, last: int | None,
               rotated: tuple[Rotated, ...]) -> str:
    """'SOUND: no findings', or, when the replay saw less than the whole run, for which steps."""
    if window is None and not rotated:
        return "SOUND: no findings"
    if first is None:
        return "NOTHING JUDGED: no step of the window is in the logs"
    seen = f"steps {first}..{last}"
    unseen = "steps rotated away" if window is None else "steps outside the window"
    if window is not None and rotated:
        unseen += " and steps rotated away"
    return f"SOUND in {seen}: no findings in what was read ({unseen}: not judged)"
