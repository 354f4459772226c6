"""Shared by the vLLM DP tests: tiny MoE checkpoints, the uneven workload, running and judging."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


from runner_fsm.audit import read_records
from runner_fsm.testing.logs import rewrite_in_full
import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job, launch_dp
from runner_fsm.testing.vllm_models import make_model


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple((7 * i + seed) % 509 + 3 for i in range(n))


# Replica 1 gets one short request and runs out of work at step ~2, while replica 0 still
# prefills (a 90-token prompt over a 64-token budget) and decodes for 12 more steps.
PER_RANK = [[("long", prompt(90, 1), 12), ("mid", prompt(23, 2), 10)], [("short", prompt(5, 4), 2)]]
ALL = [r for reqs in PER_RANK for r in reqs]
K = 2


def make_models(root: Path) -> dict[str, str]:
    return {"mixtral": make_model(root / "mixtral", "mixtral", seed=0),
            "qwen3_moe": make_model(root / "qwen3_moe", "qwen3_moe", seed=0),
            "draft": make_model(root / "draft", "mixtral", seed=1)}


# A DP rank whose own world is one worker (TP x PP x PCP = 1) runs that worker in its own process:
# vLLM's "uni" executor. vLLM's default under DP is "mp": a worker process beside each rank's engine,
# spawned (it imports vLLM again). test_vllm_dp took 118 s and 162 s of CPU so, 58 s and 102 s with
# "uni" (2026-12-07, this 2-core box; vLLM's shared-memory readers not spinning saved nothing, so
# the start-ups are the likelier cost). The served tests (test_vllm_server, test_vllm_nodes, the
# soak) start their own servers on vLLM's default layout.
ONE_PROCESS_A_RANK = {"distributed_executor_backend": "uni"}
# vLLM's default layout, kept where `uni` would change the subject or cannot run:
# - the reproduction of vLLM's own failure (test_vllm_mrv2_dp_drafts), as vLLM runs it;
# - the device configuration's DP runs: under async scheduling the "uni" executor runs the step it
#   was asked to start without waiting for (execute_model, non_block) to its end in the engine's
#   thread, so an engine whose forward waits in a DP collective cannot reach the engines' own DP
#   all-reduce (has_unfinished_dp) that the idle replica waits in: both hang (seen 2026-12-07:
#   every DP test of test-vllm-device timed out so). A device's forward returns at once.
VLLM_DEFAULT_LAYOUT = None


def kwargs(models: dict, arch: str, *, drafting: bool, worker=h.FSM_WORKER, run_dir=None, options=None,
           executor: dict | None = ONE_PROCESS_A_RANK) -> dict:
    """`executor`: None leaves vLLM's default process layout."""
    draft = dict(draft_dir=models["draft"], k=K) if drafting else {}
    return h.llm_kwargs(models[arch], worker=worker, run_dir=run_dir, runner_fsm=options, **draft, **(executor or {}))


def run(jobs: list[Job], dp_size: int, cwd: Path, timeout_s: float = 900, env=None, stop_when=None):
    return launch_dp(jobs, dp_size=dp_size, cwd=str(cwd), timeout_s=timeout_s, env=env, stop_when=stop_when)


def records(path: Path) -> list[dict]:
    """A rank's records (a rank killed by the watchdog leaves blank lines after them: skipped)."""
    return list(read_records(path))


def replay_json(run_dir: Path) -> tuple[int, list[dict]]:
    out = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "replay", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=300)
    data = json.loads(out.stdout) if out.stdout.strip() else {}
    return out.returncode, data.get("verdicts", data if isinstance(data, list) else [])


CONFESSIONS = ("fault", "injected")  # what a worker says of itself: never evidence of a finding


def stripped(run_dir: Path) -> Path:
    """A copy of the run's logs without what the workers said of themselves (their `fault` and
    `injected` records), each log's `seq` renumbered so that the cut leaves no gap: replay must
    find the fault in the evidence, and the copy must hold no finding of its own making."""
    copy = run_dir.parent / (run_dir.name + "-stripped")
    shutil.copytree(run_dir, copy, dirs_exist_ok=True)

    def without_confessions(records):
        kept = [r for r in records if r["event"] not in CONFESSIONS]
        base = records[0]["seq"] if records else 0
        return [{**r, "seq": base + i} for i, r in enumerate(kept)]

    for path in copy.glob("rank-*.jsonl"):  # in full, whatever the encoding on disk
        rewrite_in_full(path, without_confessions)
    return copy
