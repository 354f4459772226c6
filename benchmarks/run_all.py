"""The benchmark suite (`make bench`): every benchmark of issue 7, one table.

Each benchmark module exposes `rows(quick: bool) -> list[common.Row]`; it checks its own
output before it times anything and raises when that output is wrong. The suite prints one
table (figure, the baseline measured in the same run, ratio, target, pass/miss) and, with
`--readme`, writes it with the machine and the command into benchmarks/README.md between
the markers there; with `--main-readme`, five headline rows of that table (`readme.HEADLINE`)
become README.md's generated block. README numbers are never typed.

Exit status: 0 whatever the speed (a missed target is reported, never failed); 1 when a
benchmark crashed or its output was wrong, because then its figures mean nothing.

Benchmarks owned elsewhere join through hooks, when their files exist:
- benchmarks/bench_replay.py: its `rows(quick)` when it has one, else the script is run
  with `--steps 1000 --no-traced` and its `SUITE_ROW {json}` lines, or its two result lines
  (1x, 10x), become rows;
- benchmarks/bench_vllm_worker.py, only when .venv-vllm exists: run with .venv-vllm's Python
  and `--repeats 3`; its `SUITE_ROW {json}` lines, or its closing JSON summary, become rows;
- benchmarks/bench_vllm_mtp.py, likewise (MTP drafts under DP=2 x PCP=2 on MRV2): its `SUITE_ROW` lines.
Whatever cannot be read that way is shown as it is under the table.
A `SUITE_ROW` line holds one JSON object with the fields of `common.Row`.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only plan,dp,...] [--readme PATH] [--main-readme PATH]
    .venv/bin/python benchmarks/run_all.py --from-table benchmarks/README.md --main-readme README.md
    .venv/bin/python benchmarks/run_all.py --only seek --merge --readme benchmarks/README.md --main-readme README.md

`--merge` (with `--only` and `--readme`): the rows measured now replace the rows of the same
name in the table already there (and the rows `RENAMED` says they replace); every other row
stays as it was, and the summary line says which rows were measured when. `--from-table`
(`make bench-readme`) measures nothing: README.md's block is made again from the table stored
in benchmarks/README.md. `--main-readme` with `--only` needs `--merge`: the headline rows come
from the whole table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from common import Row, format_table
from readme import REMEASURED, between_markers, main_readme_block, parse_block, write_between_markers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> module; in the order of the table.
SUITE = {
    "plan": "bench_plan",  # planning speed, scaling, padding waste
    "layout": "bench_pcp_layout",  # the PCP layout vs vLLM MRV2's own (in .venv-vllm; n/a without it)
    "dp": "bench_dp_sync",  # DP agreement latency
    "bookkeeping": "bench_bookkeeping",  # bookkeeping per step
    "evidence": "bench_evidence",  # what the replay evidence costs a step (on vs off), records per step
    "prefill": "bench_prefill",  # 4096-token prefill, PCP=2 vs PCP=1
    "engine": "bench_engine",  # end-to-end tokens/s, drafting on/off
    "exchange": "bench_moe_exchange",  # expert exchange bytes/step: routed vs all-gather
    "load": "bench_load_rss",  # peak RSS of a rank loading its weights
    "perfetto": "bench_perfetto",  # Flight Recorder on vs off; replay --perfetto export speed
    "logbytes": "bench_log_bytes",  # audit log bytes per decode step: embedded, and vLLM (.venv-vllm) at both audits
    "seek": "bench_seek",  # replay --last 1000 of a 64-rank x 100k-step run; the whole run with --jobs 2
    "consensus": "bench_consensus",  # the online consensus check per step (2 ranks); digest bytes per step
    "replay": None,  # hook: benchmarks/bench_replay.py (owned elsewhere)
    "vllm": None,  # hook: benchmarks/bench_vllm_worker.py with .venv-vllm (owned elsewhere)
    "vllm-mrv2": None,  # the same on vLLM's Model Runner V2 (Triton's interpreter on the CPU)
    "vllm-device": None,  # the same in the device configuration, emulated (MRV2, graphs, JIT warm-up, async)
    "vllm-tp2": None,  # FSMWorker vs vLLM's default worker at tensor_parallel_size 2 (V1, a Mixtral)
    "vllm-mtp": None,  # hook: benchmarks/bench_vllm_mtp.py, MTP under DP=2 x PCP=2 vs DP=1 x PCP=2 (MRV2)
}
HOOK_TIMEOUT_S = 150


def _suite_rows(text: str) -> list[Row]:
    rows = []
    for line in text.splitlines():
        if line.startswith("SUITE_ROW "):
            fields = json.loads(line[len("SUITE_ROW "):])
            rows.append(Row(**{f.name: str(fields.get(f.name, "")) for f in dataclasses.fields(Row)}))
    return rows


def _script_rows(name: str, cmd: list[str], extra: list[str], parse=None, timeout_s: float = HOOK_TIMEOUT_S
                 ) -> list[Row]:
    """Run an owned-elsewhere script: its SUITE_ROW lines, else `parse(stdout)`, else one row
    pointing at its output (shown under the table)."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [Row(name, "-", "-", "-", "-", "error", note=f"`{shlex.join(cmd)}` ran past {timeout_s} s")]
    rows = _suite_rows(proc.stdout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return rows + [Row(name, "-", "-", "-", "-", "error",
                           note=f"`{shlex.join(cmd)}` exited {proc.returncode}: {' / '.join(tail)}")]
    if not rows and parse is not None:
        try:
            rows = parse(proc.stdout)
        except (ValueError, KeyError, TypeError):
            rows = []
    if rows:
        return [dataclasses.replace(r, note=(r.note + "; " if r.note else "") + f"from `{shlex.join(_short(cmd))}`")
                for r in rows]
    out = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    extra.append(f"`{shlex.join(_short(cmd))}`:\n\n```\n" + "\n".join(out[-12:]) + "\n```")
    return [Row(name, "see below the table", "-", "-", "report", "report")]


def _short(cmd: list[str]) -> list[str]:
    return [os.path.relpath(c, REPO) if os.path.isabs(c) else c for c in cmd]


_REPLAY_LINE = re.compile(r"^\s*(\d+)x:.*?([\d,]+) records,.*?([\d,]+) records/s, peak rss\s+([\d.]+) MiB", re.M)


def _parse_replay(stdout: str) -> list[Row]:
    """bench_replay.py's two lines (1x and 10x): records/s and peak RSS of each."""
    found = {int(m[1]): (int(m[2].replace(",", "")), float(m[3].replace(",", "")), float(m[4]))
             for m in _REPLAY_LINE.finditer(stdout)}
    if 1 not in found or 10 not in found:
        return []
    (rec1, rate1, rss1), (rec10, rate10, rss10) = found[1], found[10]
    growth = rss10 / rss1
    return [Row("runner-fsm replay, 10x log", f"{rate10:,.0f} rec/s, peak RSS {rss10:.1f} MiB ({rec10:,} records)",
                f"1x log: {rate1:,.0f} rec/s, {rss1:.1f} MiB ({rec1:,} records)", f"RSS {growth:.2f}x",
                "peak memory flat (<= 1.2x)", "pass" if growth <= 1.2 else "miss",
                note="one run of each size")]


def _parse_vllm(stdout: str) -> list[Row]:
    """bench_vllm_worker.py's closing JSON summary."""
    start = stdout.rfind("\n{")
    summary = json.loads(stdout[start + 1 if start >= 0 else stdout.index("{"):])
    equal = bool(summary["outputs_equal"])
    return [Row("FSMWorker in vLLM vs default CPU worker", f"FSMWorker {summary['fsm_tok_per_s']:,.0f} tok/s",
                f"default worker {summary['default_tok_per_s']:,.0f} tok/s",
                f"{summary['throughput_ratio_fsm_over_default']:.2f}x", "report the ratio",
                "report" if equal else "error",
                note=(f"{summary['requests']} requests x {summary['max_new_tokens']} new tokens; outputs"
                      f" {'equal' if equal else 'DIFFER'}"))]


def _replay_rows(quick: bool, extra: list[str]) -> list[Row]:
    script = HERE / "bench_replay.py"
    if not script.exists():
        return [Row("runner-fsm replay", "-", "-", "-", "records/s; flat peak memory at 10x", "n/a",
                    note="hook: benchmarks/bench_replay.py not present yet")]
    module = importlib.import_module("bench_replay")
    if hasattr(module, "rows"):
        return list(module.rows(quick=quick))
    cmd = [sys.executable, str(script), "--steps", "500" if quick else "1000", "--no-traced"]
    return _script_rows("runner-fsm replay", cmd, extra, _parse_replay)


def _vllm_rows(quick: bool, extra: list[str], runner: str = "v1", tp: int = 1) -> list[Row]:
    script, python = HERE / "bench_vllm_worker.py", REPO / ".venv-vllm" / "bin" / "python"
    name = "FSMWorker in vLLM vs default CPU worker" + {"v1": "", "mrv2": " (MRV2)", "device": (
        " (MRV2, device configuration emulated)")}[runner] + \
        (f", TP={tp}" if tp > 1 else "")
    if not python.exists() or not script.exists():
        missing = ".venv-vllm" if not python.exists() else "benchmarks/bench_vllm_worker.py"
        return [Row(name, "-", "-", "-", "report the ratio", "n/a", note=f"hook: {missing} not present")]
    # Three interleaved measurements per worker, each a fresh vLLM process (~15 s here on V1):
    # one of each swings the ratio by tens of percent on a shared machine, and the median of
    # three is a run that happened, not the mean of two. MRV2 runs its kernels in Triton's
    # interpreter here: a smaller workload keeps it to a few minutes.
    cmd = [str(python), str(script), "--repeats", "3", "--runner", runner]
    if runner in ("mrv2", "device"):
        cmd += ["--requests", "16", "--max-new", "16"]
    if tp > 1:  # two worker processes per measurement: a MoE model, a workload of about a minute
        cmd += ["--tp", str(tp), "--arch", "mixtral"]
    return _script_rows(name, cmd, extra, _parse_vllm, timeout_s=480 if runner == "v1" and tp == 1 else 1200)


def _vllm_mtp_rows(extra: list[str]) -> list[Row]:
    script, python = HERE / "bench_vllm_mtp.py", REPO / ".venv-vllm" / "bin" / "python"
    name = "FSMWorker MTP (K=1), DP=2 x PCP=2 vs DP=1 x PCP=2 (MRV2)"
    if not python.exists() or not script.exists():
        return [Row(name, "-", "-", "-", "report", "n/a", note="hook: .venv-vllm not present")]
    return _script_rows(name, [str(python), str(script)], extra, timeout_s=900)


def _machine() -> dict[str, str]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": cpu, "torch": torch.__version__,
            "python": platform.python_version(), "load": "%.2f %.2f %.2f" % os.getloadavg()}


def run(names: list[str], quick: bool) -> tuple[list[Row], list[str], bool]:
    rows, extra, ok = [], [], True
    for name in names:
        start = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "replay":
                got = _replay_rows(quick, extra)
            elif name in ("vllm", "vllm-mrv2", "vllm-device", "vllm-tp2"):
                got = _vllm_rows(quick, extra, runner={"vllm-mrv2": "mrv2", "vllm-device": "device"}.get(name, "v1"),
                                 tp=2 if name == "vllm-tp2" else 1)
            elif name == "vllm-mtp":
                got = _vllm_mtp_rows(extra)
            else:
                got = importlib.import_module(SUITE[name]).rows(quick=quick)
        except Exception as exc:  # a wrong output or a crash: report it, keep going
            traceback.print_exc()
            ok = False
            got = [Row(name, "-", "-", "-", "-", "error", note=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])]
        ok = ok and all(r.status != "error" for r in got
                        if name not in ("replay", "vllm", "vllm-mrv2", "vllm-device", "vllm-tp2", "vllm-mtp"))
        rows.extend(got)
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return rows, extra, ok


# Rows whose name a benchmark changed: {old name: new name}, so that `--merge` replaces them.
RENAMED = {
    "FSMWorker's own time per vLLM step, audit=transitions":
        "FSMWorker's own time per vLLM step / vLLM's worker layer, audit=transitions",
    "FSMWorker's own time per vLLM step": "FSMWorker's own time per vLLM step / vLLM's worker layer, full audit",
    "FSMWorker's own time per vLLM step, audit=transitions (MRV2)":
        "FSMWorker's own time per vLLM step / vLLM's worker layer, audit=transitions (MRV2)",
    "FSMWorker's own time per vLLM step (MRV2)":
        "FSMWorker's own time per vLLM step / vLLM's worker layer, full audit (MRV2)",
}


def merged(table_path: Path, rows: list[Row], summary: str) -> tuple[str, list[Row]]:
    """The table in `table_path` with `rows` in place of the rows of the same name (or the name
    `RENAMED` gives them); a row new to the table goes where the benchmark's first old row was,
    else at the end. The summary keeps the table's line and says what was measured now."""
    old_summary, old = parse_block(between_markers(table_path.read_text()))
    new = {row.name: row for row in rows}
    out, placed = [], set()
    for row in old:
        name = RENAMED.get(row.name, row.name)
        if name in new and name not in placed:
            out.append(new[name])
            placed.add(name)
        elif name not in new:
            out.append(row)
    out += [row for row in rows if row.name not in placed]
    return _summary(old_summary, [row.name for row in rows], summary), out


def _summary(old_summary: str, names: list[str], summary: str) -> str:
    """The table's summary line: the whole run's sentence, then per later `--merge` the rows it
    re-measured and its sentence; a re-measure whose rows are all measured again now is dropped
    (the line holds one entry per set of rows, not one per run)."""
    base, *since = old_summary.split(REMEASURED)
    measured = set(names)
    kept = [entry for entry in since
            if not {RENAMED.get(n, n) for n in re.findall(r"`([^`]+)`", entry.split(". Measured ", 1)[0])} <= measured]
    return REMEASURED.join([base, *kept, ", ".join(f"`{name}`" for name in names) + f". {summary}"])


def _regenerate_main_readme(table_path: Path, main_readme: Path) -> int:
    """README.md's block from the table already in `table_path`, without measuring."""
    summary, rows = parse_block(between_markers(table_path.read_text()))
    write_between_markers(main_readme, main_readme_block(summary, rows), create=False)
    print(f"[bench] {main_readme} regenerated from the table in {table_path}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not for the README)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SUITE)}")
    parser.add_argument("--readme", type=Path, help="write the table into this Markdown file, between markers")
    parser.add_argument("--main-readme", type=Path,
                        help="also write the table's generated block into this file (README.md), between markers")
    parser.add_argument("--merge", action="store_true",
                        help="with --only and --readme: replace only the rows measured now in the table there")
    parser.add_argument("--from-table", type=Path, metavar="BENCH_README",
                        help="measure nothing: regenerate --main-readme's block from the table in BENCH_README")
    args = parser.parse_args()
    if args.from_table:
        if not args.main_readme:
            parser.error("--from-table needs --main-readme")
        return _regenerate_main_readme(args.from_table, args.main_readme)
    if args.merge and not (args.only and args.readme):
        parser.error("--merge needs --only and --readme")
    if args.main_readme and args.only and not args.merge:
        parser.error("--main-readme with --only needs --merge (README.md's headline rows come from the whole table)")
    names = [n for n in args.only.split(",") if n] or list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(SUITE)}")
    machine = _machine()
    start = time.perf_counter()
    rows, extra, ok = run(names, args.quick)
    seconds = time.perf_counter() - start
    load_end = "%.2f %.2f %.2f" % os.getloadavg()
    command = "make bench" if os.environ.get("MAKELEVEL") else shlex.join([Path(sys.executable).name, *sys.argv])
    summary = (f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} with `{command}`"
               f"{' (--quick)' if args.quick and 'quick' not in command else ''} in {seconds:.0f} s on"
               f" {machine['nproc']} CPUs ({machine['cpu']}), torch {machine['torch']}, Python"
               f" {machine['python']}; load average (1/5/15 min) {machine['load']} at the start,"
               f" {load_end} at the end.")
    if args.merge:
        summary, rows = merged(args.readme, rows, summary)
    table = format_table(rows)
    text = "\n\n".join([summary, table, *extra])
    print("\n" + text)
    if args.readme:
        write_between_markers(args.readme, text)
        print(f"\n[bench] table written to {args.readme}", file=sys.stderr)
    if args.main_readme:
        try:
            write_between_markers(args.main_readme, main_readme_block(summary, rows), create=False)
        except ValueError as err:  # a headline row this run did not make (a benchmark that crashed)
            print(f"[bench] {args.main_readme} left as it was: {err}", file=sys.stderr)
            return 1
        print(f"[bench] generated block written to {args.main_readme}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
