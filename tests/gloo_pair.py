"""Two spawned processes in one gloo group, each writing its result as JSON: test set-up shared by
the DP sync tests that call vLLM's sync functions at function level (tests/test_vllm_mrv2_sync.py,
tests/test_mrv2_sync_033.py). `child(rank, init, out_dir)` writes `result-<rank>.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp


def run_pair(child, out_dir: Path, timeout_s: float) -> list[dict]:
    """Both ranks' results; fails naming a rank that never returned (stuck in a collective) or
    that raised (its traceback, from its result)."""
    init = f"file://{out_dir / 'rendezvous'}"
    procs = [mp.get_context("spawn").Process(target=child, args=(rank, init, str(out_dir))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    stuck = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        p.kill()
    assert stuck == [], f"rank(s) {stuck} never returned (a collective the peers did not meet)"
    results = [json.loads((out_dir / f"result-{rank}.json").read_text()) for rank in range(2)]
    for res in results:
        assert "error" not in res, res["error"]
    return results


def finish(out_dir: str, rank: int, result: dict) -> None:
    """A child's last act: its result written, then out without the interpreter's teardown. The
    gloo group outlives destroy_process_group() there (references held outside Python's gc:
    refcount 12, no gc referrers), and about one exit in ten then destroys it with its loop
    threads running: std::terminate, exit code -6, after the result was written."""
    import os
    import sys

    Path(out_dir, f"result-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
