"""Where the test tiers' time goes: the table in tests/README.md, from the phase durations that
`make test-times` has each pytest session write (tests/conftest.py, RUNNER_FSM_TEST_TIMES).

    python tests/time_table.py DIR [--readme tests/README.md | --readme -]

(`-`: the table to standard output, as `.ci/run` prints it at its end.)

Per tier: tests run, its sessions' wall time and how many tests ran at once (pytest-xdist's
workers), the tests' seconds summed, and how much went to setup (fixtures a test is the first to
need: model builds, engine start-ups), to the tests' own calls and to teardown; then the files
that cost most, and the slowest tests. The README's table sits between two marker lines and is
replaced whole, so the numbers there are always the last run's, never typed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

BEGIN, END = "<!-- test-times: begin (make test-times writes this) -->", "<!-- test-times: end -->"


def load(directory: Path) -> dict[str, list[dict]]:
    tiers = {}
    for path in sorted(directory.glob("*.jsonl")):
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"{path.name}: an unreadable line skipped", file=sys.stderr)
        tiers[path.stem] = rows
    return tiers


def table(tiers: dict[str, list[dict]], *, top: int = 8, measured: str = "") -> str:
    out = ([measured, ""] if measured else []) + [
        "| tier (-m) | tests | wall s | at once | summed s | setup s | call s | teardown s |",
        "|---|---|---|---|---|---|---|---|"]
    files_out, tests_out = [], []
    for tier, rows in tiers.items():
        phase = collections.Counter()
        per_file, per_test = collections.Counter(), collections.Counter()
        sessions = [row for row in rows if row.get("session")]
        rows = [row for row in rows if not row.get("session")]
        wall = f"{sum(row['wall_s'] for row in sessions):.0f}" if sessions else "?"
        at_once = "/".join(sorted({str(row["workers"]) for row in sessions})) or "?"
        for row in rows:
            phase[row["when"]] += row["s"]
            per_file[row["test"].split("::")[0]] += row["s"]
            per_test[row["test"]] += row["s"]
        tests = len({row["test"] for row in rows if row["when"] == "call" or row["outcome"] != "passed"})
        total = sum(phase.values())
        out.append(f"| `{tier}` | {tests} | {wall} | {at_once} | {total:.0f} | {phase['setup']:.0f} | {phase['call']:.0f} |"
                   f" {phase['teardown']:.0f} |")
        files_out.append(f"- `{tier}`: " + ", ".join(f"{name} {s:.0f} s" for name, s in per_file.most_common(top)))
        tests_out.append(f"- `{tier}`: " + ", ".join(f"{name.split('/')[-1]} {s:.0f} s"
                                                       for name, s in per_test.most_common(top)))
    return "\n".join([*out, "", "Files that cost most (setup, call and teardown of their tests):", "", *files_out,
                      "", "Slowest tests:", "", *tests_out])


def write_readme(readme: Path, text: str) -> None:
    body = readme.read_text(encoding="utf-8") if readme.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in body and END in body:
        head, _, rest = body.partition(BEGIN)
        body = head + block + rest.partition(END)[2]
    else:
        body = body.rstrip("\n") + ("\n\n" if body else "") + block + "\n"
    readme.write_text(body, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--readme", type=Path, default=Path(__file__).resolve().parent / "README.md")
    args = parser.parse_args(argv)
    tiers = load(args.directory)
    if not tiers:
        print(f"no phase durations in {args.directory}: run the tiers with RUNNER_FSM_TEST_TIMES set", file=sys.stderr)
        return 1
    import datetime
    import os
    import platform

    newest = max(path.stat().st_mtime for path in args.directory.glob("*.jsonl"))
    when = datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured = (f"Measured {when} on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs): wall time of each"
                " tier's pytest sessions, how many tests they ran at once, and seconds summed over their tests (other"
                " work on the machine then counts in them).")
    if str(args.readme) == "-":
        print(table(tiers, measured=measured))
        return 0
    write_readme(args.readme, table(tiers, measured=measured))
    print(f"wrote the table of {len(tiers)} tier(s) into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
