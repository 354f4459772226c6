"""Bytes a rank writes per decode step: its audit log's and, through vLLM, the step journal's
beside it (`vllm-steps-<rank>.jsonl`), one figure, "N B/step: log A + journal B", at a batch of
32 requests decoding on each replica (Part 27, "Honest figures": the journal is on the same
disk and under the same cap, `max_log_bytes`, as the log).

Issue 34's budget (<= 1 KB at the full audit, <= 300 B at `audit=transitions`, with room left
for Part 20's per-step digest) is the audit log's, the evidence replay judges: the row's status
and ratio judge the log against it, as before, and the figure gives the sum beside it. The
journal is diagnosis and grows with the batch (each request's scheduled tokens and sampled
token), which the log hardly does (a batch's identity is a digest); a budget for the sum would
be a new target, for an issue to set.

- embedded: real runs of the embedded engine (tiny Mixtral): DP=2 x PCP=2 with a drafter (K=1)
  and FULL_DECODE_ONLY graph replays (the most the engine logs: 8 persistent buffers, context
  identities, output digests, exchange statistics), and DP=2 alone; 32 requests a replica, all
  arriving at once; the engine has one audit level (the full one) and no journal;
- through vLLM (run here with .venv-vllm): FSMWorker, DP=2 offline (vLLM's SPMD recipe), tiny
  Mixtral, 32 requests a replica (`max_num_seqs` 32, a token budget that prefills them in one
  step), at the full audit and at `audit=transitions`.
A decode step is one whose step transition is `decode`; its bytes are its records' lines and
its journal entry's line. The figures are means over the decode steps whose batch (the journal's
scheduled requests; the engine's DP agreement's `num_reqs`) holds at least `BATCH` requests:
the tail of a run, where requests finish, is left out (its steps are smaller), and a run
without such a step is an error.

    .venv/bin/python benchmarks/bench_log_bytes.py            # both (vLLM when .venv-vllm exists)
    .venv-vllm/bin/python benchmarks/bench_log_bytes.py --vllm  # vLLM's rows alone
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
BUDGET = {"full": 1024, "transitions": 300}  # issue 34's, for the audit log
BATCH = 32  # requests decoding on a replica in the steps measured


def _journal(run_dir: Path, rank: str) -> dict[int, tuple[int, int]]:
    """{step: (bytes of its journal line, requests it scheduled)} of a rank's journal, its
    segments included; {} where there is none (the embedded engine)."""
    from runner_fsm.integrations.vllm.recording.journal_codec import decode  # either format: each line's own bytes

    out = {}
    for path in sorted(run_dir.glob(f"vllm-steps-{rank}.jsonl")) + sorted(run_dir.glob(f"vllm-steps-{rank}.*.jsonl")):
        for entry, size in decode(path.read_bytes()):
            if isinstance(entry.get("step"), int):
                out[entry["step"]] = (size, len(entry.get("sched") or ()))
    return out


def per_decode_step(run_dir: Path, batch: int = BATCH) -> dict:
    """Mean bytes a rank writes per decode step, over the decode steps of at least `batch`
    requests: its audit records' lines ("log") and its journal entry's line ("journal"), and the
    records per step; with how many decode steps there were and how many of them counted."""
    from runner_fsm.audit import read_records

    steps = size = journal = records = decode_steps = 0
    batches, journals = [], False
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        rank = path.name[len("rank-"):].split(".")[0]
        entries = _journal(run_dir, rank)
        journals = journals or bool(entries)
        lines = path.read_bytes().splitlines()
        full = list(read_records(path))
        decode = {r["step_id"] for r in full if r["event"] == "transition" and r["trigger"] == "decode"}
        # the batch: the journal's scheduled requests (vLLM), else the DP agreement's (the engine)
        reqs = {step: entry[1] for step, entry in entries.items()}
        for r in full:
            if (r["event"] == "collective" and r.get("group") == "dp" and r.get("stage") == "enqueue"
                    and isinstance(r.get("sent"), dict) and r["step_id"] not in entries):
                reqs[r["step_id"]] = max(reqs.get(r["step_id"], 0), r["sent"].get("num_reqs", 0))
        decode_steps += len(decode)
        counted = {step for step in decode if reqs.get(step, 0) >= batch}
        steps += len(counted)
        batches += [reqs[step] for step in counted]
        journal += sum(entries[step][0] for step in counted if step in entries)
        for line, record in zip(lines, full):
            if record["step_id"] in counted:
                size += len(line) + 1
                records += 1
    if not steps:
        raise SystemExit(f"{run_dir}: no decode step of {batch} requests or more ({decode_steps} decode steps)")
    return {"bytes": size / steps, "journal_bytes": journal / steps, "total_bytes": (size + journal) / steps,
            "records": records / steps, "decode_steps": decode_steps, "counted_steps": steps,
            "batch": sum(batches) / len(batches), "journal": journals}


def embedded() -> dict[str, dict]:
    from real_logs import write_real_run

    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-log-bytes-") as base:
        for name, kwargs in (("DP=2 x PCP=2, K=1, graphs", dict(dp=2, pcp=2)),
                             ("DP=2", dict(dp=2, pcp=1))):
            run = Path(base) / name.split(",")[0].replace(" ", "").replace("=", "")
            # BATCH requests a replica at once; graphs up to a decode step's BATCH x (1 + K) tokens
            write_real_run(run, requests=BATCH * kwargs["dp"], arrival_every=0, max_num_reqs=BATCH,
                           capture_sizes=(1, 2, 4, 8, 16, 32, 2 * BATCH), max_new_tokens=24, **kwargs)
            out[name] = per_decode_step(run)
    return out


def through_vllm() -> dict[str, dict]:
    """FSMWorker at DP=2 in vLLM (this interpreter must have vLLM), both audit levels."""
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_dp_cases as c
    import vllm_harness as h

    from runner_fsm.integrations.vllm.offline_dp import Job

    with tempfile.TemporaryDirectory(prefix="bench-log-bytes-vllm-") as base:
        root = Path(base)
        models = {"mixtral": c.make_model(root / "models" / "mixtral", "mixtral", seed=0)}
        per_rank = [[(f"r{rank}-{i}", c.prompt(20 + i, i + 7 * rank), 48) for i in range(BATCH)]
                    for rank in range(2)]
        # BATCH requests decoding together on each replica: as many sequences, and a token
        # budget that prefills them all in one step (prompts of 20 to 20 + BATCH - 1 tokens)
        engine = dict(max_num_seqs=BATCH, max_num_batched_tokens=2048)
        jobs = [Job(h.llm_kwargs(models["mixtral"], run_dir=str(root / level), runner_fsm={"audit": level},
                                 **engine), per_rank) for level in ("full", "transitions")]
        result = c.run(jobs, 2, root, timeout_s=900)
        if any(code != 0 for code in result.codes):
            raise SystemExit(f"the vLLM runs failed ({result.codes}):\n{result.logs[0][-3000:]}")
        return {level: per_decode_step(root / level) for level in ("full", "transitions")}


def figure(got: dict) -> str:
    """The row's figure: "N B/step: log A + journal B" (the embedded engine writes no journal)."""
    if not got["journal"]:
        return f"{got['total_bytes']:,.0f} B/step: log {got['bytes']:,.0f}, no journal ({got['records']:.1f} records)"
    return (f"{got['total_bytes']:,.0f} B/step: log {got['bytes']:,.0f} + journal {got['journal_bytes']:,.0f}"
            f" ({got['records']:.1f} records)")


def _steps(got: dict, ranks: str) -> str:
    left = got["decode_steps"] - got["counted_steps"]
    return (f"{got['counted_steps']} decode steps over {ranks} at a batch of {BATCH} requests or more (mean"
            f" {got['batch']:.1f}"
            + (f"; {left} of the run's {got['decode_steps']} decode steps, its tail, had fewer)" if left else
               "; every decode step of the run)"))


_BUDGET_NOTE = ("the target is issue 34's budget for the audit log, the evidence replay judges: status and ratio"
                " judge the log, the figure adds the journal written beside it (diagnosis, under the same cap,"
                " growing with the batch)")


def _rows_vllm(measured: dict[str, dict]) -> list[dict]:
    rows = []
    for level, got in measured.items():
        budget = BUDGET[level]
        rows.append(dict(name=f"audit log bytes per decode step and rank, vLLM DP=2, audit={level}",
                         figure=figure(got), baseline="-",
                         ratio=f"log {got['bytes'] / budget:.2f} of the budget", target=f"log <= {budget} B",
                         status="pass" if got["bytes"] <= budget else "miss",
                         note=(f"FSMWorker, tiny Mixtral, {_steps(got, '2 ranks')}; compact records (issue 34);"
                               f" {_BUDGET_NOTE}")))
    return rows


def _rows_embedded(measured: dict[str, dict], row) -> list:
    return [row(f"audit log bytes per decode step and rank, embedded {name}", figure(got), "-",
                f"log {got['bytes'] / BUDGET['full']:.2f} of the budget", f"log <= {BUDGET['full']} B (full audit)",
                "pass" if got["bytes"] <= BUDGET["full"] else "miss",
                note=f"real run, tiny Mixtral, {_steps(got, 'its ranks')}; the engine has one audit level and"
                     " writes no journal")
            for name, got in measured.items()]


def rows(quick: bool = False) -> list:
    from common import Row

    out = _rows_embedded(embedded(), Row)
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return out + [Row("audit log bytes per decode step and rank, vLLM", "-", "-", "-", "log <= 1 KB / <= 300 B",
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
