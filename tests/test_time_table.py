"""tests/time_table.py: the README's table of where the tiers' time goes, from the phase
durations each pytest session writes (tests/conftest.py). Mutation seen to fail the first test:
`write_readme` appending a new block instead of replacing the one between the markers."""

from __future__ import annotations

import json
from pathlib import Path

import time_table


def _write(directory: Path, tier: str, rows: list[tuple[str, str, float]], junk: str = "") -> None:
    lines = [json.dumps({"test": t, "when": w, "s": s, "outcome": "passed"}) for t, w, s in rows]
    (directory / f"{tier}.jsonl").write_text("\n".join(lines + ([junk] if junk else [])) + "\n")


def test_table_splits_setup_call_and_teardown_per_tier_and_replaces_its_block(tmp_path, capsys):
    _write(tmp_path, "vllm_and_not_slow", [("tests/a.py::t1", "setup", 40.0), ("tests/a.py::t1", "call", 5.0),
                                           ("tests/a.py::t1", "teardown", 1.0), ("tests/b.py::t2", "setup", 0.5),
                                           ("tests/b.py::t2", "call", 12.0), ("tests/b.py::t2", "teardown", 0.0)],
           junk="{not json")
    _write(tmp_path, "not_vllm_and_not_slow", [("tests/c.py::t3", "call", 2.0)])
    readme = tmp_path / "README.md"
    readme.write_text(f"# Tiers\n\nbefore\n\n{time_table.BEGIN}\nold numbers\n{time_table.END}\n\nafter\n")
    assert time_table.main([str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("# Tiers\n\nbefore") and text.endswith("after\n")
    assert "| `vllm_and_not_slow` | 2 | 58 | 40 | 17 | 1 |" in text
    assert "| `not_vllm_and_not_slow` | 1 | 2 | 0 | 2 | 0 |" in text
    assert "- `vllm_and_not_slow`: tests/a.py 46 s, tests/b.py 12 s" in text
    assert "an unreadable line skipped" in capsys.readouterr().err


def test_no_times_is_an_error_not_an_empty_table(tmp_path):
    readme = tmp_path / "README.md"
    assert time_table.main([str(tmp_path), "--readme", str(readme)]) == 1
    assert not readme.exists()
