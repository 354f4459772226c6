"""README numbers come from one table: `make bench` writes benchmarks/README.md, and README.md's
generated block holds five headline rows copied from it (benchmarks/readme.py); nothing is typed by
hand, and `run_all.py --from-table` makes the block again from the stored table without measuring."""

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Row, format_table  # noqa: E402
from readme import (  # noqa: E402
    BEGIN, END, HEADLINE, between_markers, headline_rows, main_readme_block, measured_when, parse_block,
    write_between_markers,
)

ROWS = [
    Row("PCP plan, 512 reqs, P=2", "18.3 ms [12.3-20.5]", "per-request Python 368 ms [321-434]", "22.9x faster",
        ">= 10x", "pass", note="579,906 tokens"),
    Row("bookkeeping per step (CPU)", "135 us [129-145]", "10 ms step (100 us = 1%)", "1.35%", "<= 1%", "miss"),
]
SUMMARY = ("Measured 2026-11-30 02:50 UTC with `make bench` in 136 s on 2 CPUs (AMD EPYC), torch 2.13.0+cpu,"
           " Python 3.11.7; load average (1/5/15 min) 1.00 1.00 1.00 at the start, 2.00 2.00 2.00 at the end.")


def test_the_main_readme_block_is_made_from_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Numbers\n\nprose before\n\n{BEGIN}\n| typed | by hand |\n{END}\n\nprose after\n")
    write_between_markers(readme, main_readme_block(SUMMARY, ROWS, headline=(ROWS[1].name,)), create=False)
    text = readme.read_text()
    assert text.startswith("# x\n\n## Numbers\n\nprose before\n\n" + BEGIN + "\n")
    assert text.endswith(END + "\n\nprose after\n")
    block = between_markers(text)
    assert "typed" not in block
    assert "[benchmarks/README.md](benchmarks/README.md)" in block and "all 2 rows" in block
    assert "2 CPUs" in block  # the machine, from the summary line
    item = " ".join(block.split(f"- **{ROWS[1].name}**: ", 1)[1].split())
    assert item.startswith(f"{ROWS[1].figure}; baseline in the same run: {ROWS[1].baseline}; ratio {ROWS[1].ratio};"
                           f" target {ROWS[1].target}: {ROWS[1].status}; measured 2026-11-30 02:50 UTC.")
    assert ROWS[0].figure not in block  # not a headline row
    assert max(len(line) for line in block.splitlines()) <= 120


def test_only_the_headline_rows_go_to_the_main_readme_in_its_order():
    """Mutation seen to fail this: every row of the table in README.md's block."""
    extra = Row("a third row", "7 us", "8 us", "0.88x", "report", "report", note="its note")
    block = main_readme_block(SUMMARY, [*ROWS, extra], headline=(extra.name, ROWS[0].name))
    items = [line for line in block.splitlines() if line.startswith("- ")]
    assert [item.split("**")[1] for item in items] == [extra.name, ROWS[0].name]
    assert ROWS[1].figure not in block and "its note" not in block and "579,906 tokens" not in block
    assert [r.name for r in headline_rows([*ROWS, extra], (extra.name, ROWS[0].name))] == [extra.name, ROWS[0].name]


def test_a_headline_row_missing_from_the_table_is_an_error():
    with pytest.raises(ValueError, match="headline rows missing from the table: \\['a renamed row'\\]"):
        main_readme_block(SUMMARY, ROWS, headline=(ROWS[0].name, "a renamed row"))


def test_each_row_is_dated_by_the_run_that_last_measured_it():
    """The summary line names, per `--merge`, the rows it measured again and when. Mutation seen
    to fail this: every row dated by the whole run's sentence."""
    summary = (f"{SUMMARY} Re-measured since: `{ROWS[0].name}`. Measured 2026-12-04 08:54 UTC with `x` in 5 s."
               f" Re-measured since: `a`, `{ROWS[0].name}`. Measured 2026-12-05 11:15 UTC with `y` in 6 s.")
    assert measured_when(summary, ROWS[0].name) == "2026-12-05 11:15 UTC"
    assert measured_when(summary, ROWS[1].name) == "2026-11-30 02:50 UTC"
    assert measured_when(SUMMARY, ROWS[0].name) == "2026-11-30 02:50 UTC"
    block = main_readme_block(summary, ROWS, headline=(ROWS[1].name, ROWS[0].name))
    assert block.index("2026-11-30 02:50 UTC") < block.index("2026-12-05 11:15 UTC")


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
    assert len(HEADLINE) == 5 and {r.name for r in headline_rows(rows)} == set(HEADLINE)
    block = between_markers((REPO / "README.md").read_text())
    assert block == main_readme_block(summary, rows)
    assert len([line for line in block.splitlines() if line.startswith("- **")]) == 5


def test_from_table_makes_the_block_again_without_measuring(tmp_path):
    """`run_all.py --from-table` (`make bench-readme`): README.md's block from the stored table."""
    from run_all import _regenerate_main_readme

    rows = [Row(name, f"{i} us", "-", "-", "report", "report") for i, name in enumerate(HEADLINE)]
    table, readme = tmp_path / "bench.md", tmp_path / "README.md"
    table.write_text(f"# B\n\n{BEGIN}\n{SUMMARY}\n\n{format_table([ROWS[0], *rows])}\n{END}\n")
    readme.write_text(f"# R\n\n{BEGIN}\nold\n{END}\n")
    assert _regenerate_main_readme(table, readme) == 0
    assert between_markers(readme.read_text()) == main_readme_block(SUMMARY, [ROWS[0], *rows])
    assert ROWS[0].figure not in readme.read_text()


def test_a_partial_run_cannot_write_the_main_readme(monkeypatch, capsys):
    """`--only` without `--merge` measures a few rows: README.md's headline needs the whole table."""
    import run_all

    monkeypatch.setattr(sys, "argv", ["run_all.py", "--only", "plan", "--main-readme", "README.md"])
    with pytest.raises(SystemExit) as exit_:
        run_all.main()
    assert exit_.value.code == 2
    assert "--main-readme with --only needs --merge" in capsys.readouterr().err


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

