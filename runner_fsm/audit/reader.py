"""Finding the rank files of a run and where each process sits in the DP x PCP layout.

A rank's coordinates come from its own records (`dp_rank`, `pcp_rank`); a file with no
readable record (killed before its first line was complete) gets them from its global rank
and the PCP size its siblings show, so that it can still be named in verdicts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from itertools import islice
from pathlib import Path

import orjson

from runner_fsm.audit.verdicts import ReplayInputError

RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
_PROBE_LINES = 64  # enough to get past a damaged first line, few enough to stay instant


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One process of the run: its global rank, its coordinates and its log file."""

    global_rank: int
    dp_rank: int
    pcp_rank: int
    path: Path

    @property
    def file(self) -> str:
        return self.path.name


def discover(run_dir: str | os.PathLike[str]) -> list[RankInfo]:
    """Every rank file of `run_dir` with its coordinates; `ReplayInputError` if none can be read."""
    directory = Path(run_dir)
    if not directory.exists():
        raise ReplayInputError(f"run directory {directory} does not exist")
    if not directory.is_dir():
        raise ReplayInputError(f"{directory} is not a directory (expected a run directory of rank-*.jsonl)")
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise ReplayInputError(f"cannot list run directory {directory}: {err}") from err
    ranked = sorted((int(m[1]), directory / name) for name in names if (m := RANK_FILE.match(name)))
    if not ranked:
        raise ReplayInputError(f"no rank-<global_rank>.jsonl files in {directory}; is it a run directory?")
    probed = {rank: _probe_coords(path) for rank, path in ranked}
    pcp_size = 1 + max((coords[1] for coords in probed.values() if coords), default=0)
    return [RankInfo(rank, *(probed[rank] or divmod(rank, pcp_size)), path) for rank, path in ranked]


def _probe_coords(path: Path) -> tuple[int, int] | None:
    """(dp_rank, pcp_rank) from the first record that has both, or None."""
    try:
        with open(path, "rb") as lines:
            for raw in islice(lines, _PROBE_LINES):
                try:
                    record = orjson.loads(raw)
                    dp_rank, pcp_rank = record["dp_rank"], record["pcp_rank"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
                if isinstance(dp_rank, int) and isinstance(pcp_rank, int):
                    return dp_rank, pcp_rank
    except OSError as err:
        raise ReplayInputError(f"cannot read {path}: {err}") from err
    return None


def layout_of(infos: list[RankInfo]) -> tuple[int, int]:
    """(replicas, pcp_size) as the rank files show them."""
    return 1 + max(i.dp_rank for i in infos), 1 + max(i.pcp_rank for i in infos)
