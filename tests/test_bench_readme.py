"""README numbers come from one table: `make bench` writes benchmarks/README.md and README.md's
generated block from the same rows (benchmarks/readme.py); nothing is typed by hand."""

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Row, format_table  # noqa: E402
from readme import BEGIN, END, between_markers, main_readme_block, parse_block, write_between_markers  # noqa: E402

ROWS = [
    Row("PCP plan, 512 reqs, P=2", "18.3 ms [12.3-20.5]", "per-request Python 368 ms [321-434]", "22.9x faster",
        ">= 10x", "pass", note="579,906 tokens"),
    Row("bookkeeping per step (CPU)", "135 us [129-145]", "10 ms step (100 us = 1%)", "1.35%", "<= 1%", "miss"),
]
SUMMARY = "Measured 2026-11-30 02:50 UTC with `make bench` in 136 s on 2 CPUs."


def test_the_main_readme_block_is_made_from_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Numbers\n\nprose before\n\n{BEGIN}\n| typed | by hand |\n{END}\n\nprose after\n")
    write_between_markers(readme, main_readme_block(SUMMARY, ROWS), create=False)
    text = readme.read_text()
    assert text.startswith("# x\n\n## Numbers\n\nprose before\n\n" + BEGIN + "\n")
    assert text.endswith(END + "\n\nprose after\n")
    block = between_markers(text)
    assert "typed" not in block
    assert SUMMARY in block
    assert format_table([Row(*[getattr(r, f) for f in ("name", "figure", "baseline", "ratio", "target", "status")])
                         for r in ROWS]) in block  # the same rows, without their notes
    assert "579,906 tokens" not in block


def test_a_table_run_all_wrote_parses_back_to_its_rows():
    summary, rows = parse_block(f"{SUMMARY}\n\n{format_table(ROWS)}\n")
    assert summary == SUMMARY
    assert rows == ROWS


def test_a_readme_without_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n| typed | by hand |\n")
    with pytest.raises(ValueError, match="no <!-- bench:begin --> ... <!-- bench:end --> block"):
        write_between_markers(readme, "generated", create=False)
    assert readme.read_text() == "# x\n\n| typed | by hand |\n"


def test_readme_numbers_are_the_benchmark_table():
    summary, rows = parse_block(between_markers((REPO / "benchmarks" / "README.md").read_text()))
    assert len(rows) >= 10
    assert between_markers((REPO / "README.md").read_text()) == main_readme_block(summary, rows)


def test_a_merge_replaces_only_the_rows_measured_again(tmp_path):
    """`run_all.py --only X --merge`: X's rows replace theirs (a renamed row included, in its
    place), the others stay as they were, and the summary says what was measured when."""
    from run_all import merged

    old_own = Row("FSMWorker's own time per vLLM step", "218.3 us", "vLLM's worker layer 72.9 us", "-", "<= 100 us",
                  "miss", note="old")
    table = tmp_path / "README.md"
    table.write_text(f"{BEGIN}\n{SUMMARY}\n\n{format_table([ROWS[0], old_own, ROWS[1]])}\n{END}\n")
    own = Row("FSMWorker's own time per vLLM step / vLLM's worker layer, full audit", "200 us", "vLLM's worker layer"
              " 70 us", "2.86x [2.7-3.0]", "<= 1.0x", "miss", note="new")
    plan = Row(ROWS[0].name, "17.0 ms", ROWS[0].baseline, "25.0x faster", ">= 10x", "pass", note="again")
    fresh = Row("a row no table had", "1", "2", "0.5x", "report", "report")
    summary, rows = merged(table, [own, plan, fresh], "Measured 2026-12-03 10:30 UTC with `x`.")
    assert [r.name for r in rows] == [ROWS[0].name, own.name, ROWS[1].name, fresh.name]
    assert rows[0] == plan and rows[1] == own and rows[2] == ROWS[1]
    assert summary.startswith(SUMMARY) and summary.endswith("Measured 2026-12-03 10:30 UTC with `x`.")
    assert f"`{own.name}`" in summary and f"`{ROWS[1].name}`" not in summary


def test_the_summary_keeps_one_entry_per_set_of_rows_measured_again(tmp_path):
    """Each `--merge` names the rows it measured and its own "Measured ..." sentence; an entry
    whose rows are all measured again later goes (the line stays one entry per set of rows, not
    one per run), one that still holds a row not measured again stays. Mutation seen to fail
    this: keeping every earlier entry (the line grows by one sentence a run)."""
    from run_all import merged

    table = tmp_path / "README.md"
    table.write_text(f"{BEGIN}\n{SUMMARY}\n\n{format_table(ROWS)}\n{END}\n")
    again = lambda row, figure: dataclasses.replace(row, figure=figure)  # noqa: E731
    for i, (rows, when) in enumerate((([ROWS[0]], "10:00"), ([ROWS[1]], "11:00"), ([ROWS[0]], "12:00"),
                                      ([ROWS[0], ROWS[1]], "13:00"), ([ROWS[0]], "14:00"))):
        summary, merged_rows = merged(table, [again(r, f"{i}") for r in rows],
                                      f"Measured 2026-12-04 {when} UTC with `python benchmarks/run_all.py --only x`.")
        table.write_text(f"{BEGIN}\n{summary}\n\n{format_table(merged_rows)}\n{END}\n")
    assert summary.startswith(SUMMARY)
    entries = summary[len(SUMMARY):].split(" Re-measured since: ")[1:]
    assert [e.split("Measured 2026-12-04 ")[1][:5] for e in entries] == ["13:00", "14:00"]
    assert entries[0].startswith(f"`{ROWS[0].name}`, `{ROWS[1].name}`. ")
    assert entries[1].startswith(f"`{ROWS[0].name}`. ")

