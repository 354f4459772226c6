"""The benchmark table in the two READMEs: one table, written by `make bench`, never typed.

`benchmarks/README.md` holds the full table (summary line, table, notes) between the markers.
README.md holds a generated block of five headline rows (`HEADLINE`) copied from that table,
each with the date of the run that last measured it, and a link to the rest. `run_all.py
--from-table` (`make bench-readme`) regenerates README.md's block from the table already in
benchmarks/README.md, without measuring again.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

from common import Row

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
_HEAD = "| benchmark "
# The summary line: the whole run's sentence, then per later `run_all.py --merge` this, the rows
# it measured again and its own "Measured ..." sentence.
REMEASURED = " Re-measured since: "

# README.md's rows, in its order: names of rows of the full table (a row missing there is an error).
HEADLINE = (
    "FSMWorker in vLLM vs default CPU worker",  # whole-step throughput inside vLLM (V1)
    "FSMWorker's own time per vLLM step / vLLM's worker layer, audit=transitions",  # the wrapper's cost
    "fast_pcp_layout vs vLLM MRV2 manager, realistic step, P=4",  # the PCP layout installed in vLLM
    "runner-fsm replay, 10x log (real)",  # judging a run offline: speed, flat memory
    "audit log bytes per decode step and rank, vLLM DP=2, audit=full",  # what the evidence costs on disk
)
_WIDTH = 100  # README.md's lines


def between_markers(text: str) -> str:
    """The text between the markers (a `ValueError` when they are missing)."""
    if BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_between_markers(path: Path, block: str, *, create: bool = True) -> None:
    """Replace what is between the markers of `path` with `block`. A file without markers gets
    them appended when `create`; otherwise it is an error (README.md must carry them)."""
    old = path.read_text() if path.exists() else ""
    if BEGIN not in old or END not in old:
        if not create:
            raise ValueError(f"{path} has no {BEGIN} ... {END} block to fill")
        old = (old.rstrip() + "\n\n" if old.strip() else "# Benchmarks\n\n") + f"{BEGIN}\n{END}\n"
    head, rest = old.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def parse_block(block: str) -> tuple[str, list[Row]]:
    """The summary line and the rows (notes included) of a block `run_all` wrote."""
    lines = block.splitlines()
    summary = next((line for line in lines if line.startswith("Measured ")), "")
    start = next(i for i, line in enumerate(lines) if line.startswith(_HEAD))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 6:
            raise ValueError(f"a table row with {len(cells)} cells, not 6: {line!r}")
        rows.append(Row(*cells))
    notes = {}
    for line in lines:
        for row in rows:
            if line.startswith(f"- {row.name}: ") and row.name not in notes:
                notes[row.name] = line[len(f"- {row.name}: "):]
    return summary, [dataclasses.replace(r, note=notes.get(r.name, "")) for r in rows]


def _runs(summary: str) -> list[tuple[str, set[str] | None]]:
    """Each run the summary line names: its "Measured ..." sentence and the rows it measured
    (None: the whole run's sentence, which measured every row)."""
    base, *since = summary.split(REMEASURED)
    runs: list[tuple[str, set[str] | None]] = [(base, None)]
    for entry in since:
        names, _, sentence = entry.partition(". Measured ")
        runs.append(("Measured " + sentence, set(re.findall(r"`([^`]+)`", names))))
    return runs


def measured_when(summary: str, name: str) -> str:
    """When the row `name` was last measured ("2026-12-05 11:15 UTC"), from the summary line."""
    when = ""
    for sentence, names in _runs(summary):
        if names is None or name in names:
            when = sentence[len("Measured "):].split(" with ", 1)[0]
    return when


def _machines(summary: str) -> list[str]:
    """The machines the summary's runs name ("2 CPUs (AMD EPYC), torch 2.13.0+cpu, Python 3.11.7")."""
    found = []
    for sentence, _ in _runs(summary):
        match = re.search(r" on (\d+ CPUs \(.*?\)), torch ([^,]+), Python ([^;]+);", sentence)
        text = f"{match[1]}, torch {match[2]}, Python {match[3]}" if match else ""
        if text and text not in found:
            found.append(text)
    return found


def headline_rows(rows: list[Row], headline: tuple[str, ...] = HEADLINE) -> list[Row]:
    """The rows `headline` names, in its order (a `ValueError` naming any the table lacks)."""
    by_name = {row.name: row for row in rows}
    missing = [name for name in headline if name not in by_name]
    if missing:
        raise ValueError(f"README.md's headline rows missing from the table: {missing}"
                         " (a benchmark renamed its row? update readme.HEADLINE)")
    return [by_name[name] for name in headline]


def _item(row: Row, when: str) -> str:
    parts = [row.figure]
    if row.baseline not in ("", "-"):
        parts.append(f"baseline in the same run: {row.baseline}")
    if row.ratio not in ("", "-"):
        parts.append(f"ratio {row.ratio}")
    parts += [f"target {row.target}: {row.status}", f"measured {when or 'at a date the table does not give'}"]
    text = f"**{row.name}**: " + "; ".join(parts) + "."
    return textwrap.fill(text, _WIDTH, initial_indent="- ", subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)


def main_readme_block(summary: str, rows: list[Row], headline: tuple[str, ...] = HEADLINE) -> str:
    """README.md's block: the headline rows, without their notes, each with when it was measured,
    and where the rest is."""
    picked = headline_rows(rows, headline)
    machines = "; ".join(_machines(summary)) or "the machine benchmarks/README.md names"
    intro = (f"The headline rows of the table in [benchmarks/README.md](benchmarks/README.md) (all"
             f" {len(rows)} rows, their notes, the commands and how to read them), measured on {machines}.")
    return "\n\n".join([
        "<!-- generated by `make bench` (benchmarks/run_all.py) from benchmarks/README.md;"
        " edits here are overwritten -->",
        textwrap.fill(intro, _WIDTH, break_long_words=False, break_on_hyphens=False),
        "\n".join(_item(row, measured_when(summary, row.name)) for row in picked),
    ])
