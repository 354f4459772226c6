"""tests/time_table.py: the README's table of where the tiers' time goes, from the phase
durations each pytest session writes (tests/conftest.py). Mutation seen to fail the first test:
`write_readme` appending a new block instead of replacing the one between the markers."""

from __future__ import annotations

import json
from pathlib import Path

import time_table


def _write(directory: Path, tier: str, rows: list[tuple[str, str, float]], junk: str = "",
           sessions: tuple[tuple[float, int], ...] = ()) -> None:
    lines = [json.dumps({"test": t, "when": w, "s": s, "outcome": "passed"}) for t, w, s in rows]
    lines += [json.dumps({"session": True, "wall_s": wall, "workers": workers}) for wall, workers in sessions]
    (directory / f"{tier}.jsonl").write_text("\n".join(lines + ([junk] if junk else [])) + "\n")


def test_table_splits_setup_call_and_teardown_per_tier_and_replaces_its_block(tmp_path, capsys):
    _write(tmp_path, "vllm_and_not_slow", [("tests/a.py::t1", "setup", 40.0), ("tests/a.py::t1", "call", 5.0),
                                           ("tests/a.py::t1", "teardown", 1.0), ("tests/b.py::t2", "setup", 0.5),
                                           ("tests/b.py::t2", "call", 12.0), ("tests/b.py::t2", "teardown", 0.0)],
           junk="{not json", sessions=((30.0, 2), (20.4, 2)))
    _write(tmp_path, "not_vllm_and_not_slow", [("tests/c.py::t3", "call", 2.0)])
    readme = tmp_path / "README.md"
    readme.write_text(f"# Tiers\n\nbefore\n\n{time_table.BEGIN}\nold numbers\n{time_table.END}\n\nafter\n")
    assert time_table.main([str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("# Tiers\n\nbefore") and text.endswith("after\n")
    # two sessions of two workers: their walls add up; a tier that wrote no session line has none
    assert "| `vllm_and_not_slow` | 2 | 50 | 2 | 58 | 40 | 17 | 1 |" in text
    assert "| `not_vllm_and_not_slow` | 1 | ? | ? | 2 | 0 | 2 | 0 |" in text
    assert "- `vllm_and_not_slow`: tests/a.py 46 s, tests/b.py 12 s" in text
    assert "an unreadable line skipped" in capsys.readouterr().err


def test_no_times_is_an_error_not_an_empty_table(tmp_path):
    readme = tmp_path / "README.md"
    assert time_table.main([str(tmp_path), "--readme", str(readme)]) == 1
    assert not readme.exists()


def test_a_session_of_two_workers_writes_each_phase_once_and_its_wall(tmp_path):
    """Under pytest-xdist the controller alone writes (the workers' reports reach it through the
    same hook). Mutation seen to fail it: the workers writing too (every phase twice)."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    times = tmp_path / "times"
    env = {**os.environ, "RUNNER_FSM_TEST_TIMES": str(times)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           f"{here / 'test_time_table.py'}::test_no_times_is_an_error_not_an_empty_table",
                           f"{here / 'test_time_table.py'}::test_table_splits_setup_call_and_teardown_per_tier_and_replaces_its_block"],
                          cwd=here.parent, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (written,) = times.glob("*.jsonl")  # one tier: the session's
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    phases = [(row["test"], row["when"]) for row in rows if not row.get("session")]
    assert len(phases) == 6 and len(set(phases)) == 6, phases
    sessions = [row for row in rows if row.get("session")]
    assert len(sessions) == 1 and sessions[0]["workers"] == 2 and sessions[0]["wall_s"] > 0, sessions
