"""Bytes the audit log takes per decode step and rank (issue 34's budget: <= 1 KB at the full
audit, <= 300 B at `audit=transitions`, with room left for Part 20's per-step digest).

- embedded: real runs of the embedded engine (tiny Mixtral): DP=2 x PCP=2 with a drafter (K=1)
  and FULL_DECODE_ONLY graph replays (the most the engine logs: 8 persistent buffers, context
  identities, output digests, exchange statistics), and DP=2 alone; the engine has one audit
  level (the full one);
- through vLLM (run here with .venv-vllm): FSMWorker, DP=2 offline (vLLM's SPMD recipe), tiny
  Mixtral, at the full audit and at `audit=transitions`; the step journal beside the log
  (`vllm-steps-<rank>.jsonl`, diagnosis) is counted apart.
A decode step is one whose step transition is `decode`; its bytes are its records' lines.

    .venv/bin/python benchmarks/bench_log_bytes.py            # both (vLLM when .venv-vllm exists)
    .venv-vllm/bin/python benchmarks/bench_log_bytes.py --vllm  # vLLM's rows alone
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
BUDGET = {"full": 1024, "transitions": 300}


def per_decode_step(run_dir: Path) -> dict:
    """Mean bytes (and records) of a decode step's audit records, per rank; the journal's."""
    from runner_fsm.audit import read_records

    steps = collections.Counter()
    size: collections.Counter = collections.Counter()
    records: collections.Counter = collections.Counter()
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        lines = path.read_bytes().splitlines()
        full = list(read_records(path))
        decode = {r["step_id"] for r in full if r["event"] == "transition" and r["trigger"] == "decode"}
        steps[path.name] = len(decode)
        for line, record in zip(lines, full):
            if record["step_id"] in decode:
                size[path.name] += len(line) + 1
                records[path.name] += 1
    total = sum(steps.values())
    journal = sum(p.stat().st_size for p in run_dir.glob("vllm-steps-*.jsonl"))
    all_steps = len({(p.name, r["step_id"]) for p in run_dir.glob("rank-*.jsonl") for r in read_records(p)
                     if isinstance(r["step_id"], int) and r["step_id"] >= 0})
    return {"bytes": sum(size.values()) / total, "records": sum(records.values()) / total, "decode_steps": total,
            "journal_bytes": journal / all_steps if all_steps else 0.0}


def embedded() -> dict[str, dict]:
    from real_logs import write_real_run

    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-log-bytes-") as base:
        for name, kwargs in (("DP=2 x PCP=2, K=1, graphs", dict(dp=2, pcp=2)),
                             ("DP=2", dict(dp=2, pcp=1))):
            run = Path(base) / name.split(",")[0].replace(" ", "").replace("=", "")
            write_real_run(run, requests=12, **kwargs)
            out[name] = per_decode_step(run)
    return out


def through_vllm() -> dict[str, dict]:
    """FSMWorker at DP=2 in vLLM (this interpreter must have vLLM), both audit levels."""
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_dp_cases as c

    from runner_fsm.integrations.vllm.offline_dp import Job

    with tempfile.TemporaryDirectory(prefix="bench-log-bytes-vllm-") as base:
        root = Path(base)
        models = {"mixtral": c.make_model(root / "models" / "mixtral", "mixtral", seed=0)}
        per_rank = [[(f"r{rank}-{i}", c.prompt(20 + i, i + 7 * rank), 48) for i in range(8)] for rank in range(2)]
        jobs = [Job(c.kwargs(models, "mixtral", drafting=False, run_dir=str(root / level),
                             options={"audit": level}), per_rank) for level in ("full", "transitions")]
        result = c.run(jobs, 2, root, timeout_s=900)
        if any(code != 0 for code in result.codes):
            raise SystemExit(f"the vLLM runs failed ({result.codes}):\n{result.logs[0][-3000:]}")
        return {level: per_decode_step(root / level) for level in ("full", "transitions")}


def _rows_vllm(measured: dict[str, dict]) -> list[dict]:
    rows = []
    for level, got in measured.items():
        budget = BUDGET[level]
        rows.append(dict(name=f"audit log bytes per decode step and rank, vLLM DP=2, audit={level}",
                         figure=f"{got['bytes']:,.0f} B ({got['records']:.1f} records)",
                         baseline=f"step journal beside it: {got['journal_bytes']:,.0f} B/step",
                         ratio=f"{got['bytes'] / budget:.2f} of the budget", target=f"<= {budget} B",
                         status="pass" if got["bytes"] <= budget else "miss",
                         note=(f"FSMWorker, tiny Mixtral, {got['decode_steps']} decode steps over 2 ranks; compact"
                               " records (issue 34); the journal is diagnosis, capped with the log")))
    return rows


def _rows_embedded(measured: dict[str, dict], row) -> list:
    return [row(f"audit log bytes per decode step and rank, embedded {name}",
                f"{got['bytes']:,.0f} B ({got['records']:.1f} records)", "-",
                f"{got['bytes'] / BUDGET['full']:.2f} of the budget", f"<= {BUDGET['full']} B (full audit)",
                "pass" if got["bytes"] <= BUDGET["full"] else "miss",
                note=f"real run, tiny Mixtral, {got['decode_steps']} decode steps over its ranks; the engine"
                     " has one audit level")
            for name, got in measured.items()]


def rows(quick: bool = False) -> list:
    from common import Row

    out = _rows_embedded(embedded(), Row)
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return out + [Row("audit log bytes per decode step and rank, vLLM", "-", "-", "-", "<= 1 KB / <= 300 B",
                          "n/a", note=".venv-vllm not present")]
    proc = subprocess.run([str(python), __file__, "--vllm"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    found = [json.loads(line[len("SUITE_ROW "):]) for line in proc.stdout.splitlines() if line.startswith("SUITE_ROW ")]
    if proc.returncode != 0 or not found:
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return out + [Row("audit log bytes per decode step and rank, vLLM", "-", "-", "-", "-", "error",
                          note=f"bench_log_bytes.py --vllm exited {proc.returncode}: {tail}")]
    return out + [Row(**{k: str(v) for k, v in row.items()}) for row in found]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="store_true", help="vLLM's rows alone (run with .venv-vllm's Python)")
    args = parser.parse_args()
    if args.vllm:
        for row in _rows_vllm(through_vllm()):
            print("SUITE_ROW " + json.dumps(row), flush=True)
        return 0
    for row in rows():
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
