"""The PCP layout against vLLM MRV2's own, on identical inputs, in one process.

- `plan_batch(chunking="mrv2")` + `num_tokens_for_dispatch` against vLLM's
  `PCPManager._build_batch_layout` + `get_num_tokens_for_dispatch` (decodes sharded, DCP = 1,
  vLLM's rule), on the planning benchmark's 512-request batch (1/4 prefills of 1-8192
  tokens, the rest decodes) at P = 2, 4, 8, and on a realistic step (8192 tokens: 256
  decodes, prefills filling the rest) at P = 2, 4, 8; the outputs are compared array by
  array before anything is timed, and the two are interleaved repeat by repeat (so each of
  ours starts with the caches as vLLM's call left them). Ours writes into a `PlanWorkspace`
  kept across repeats, as the engine keeps one across steps; the per-rank rows (positions,
  request of each row), which vLLM's layout does not build either, are not timed. The
  verdict is on the interleaved ratio; the row note adds both sides back to back (each
  alone, call after call, caches warm), the other common way to time them.
- `fast_pcp_layout`: MRV2's manager with it installed (on the instance, as FSMWorker does)
  against vLLM's own, like for like, on the realistic step at P = 2, 4, 8:
  `_build_batch_layout` + `get_num_tokens_for_dispatch` + reading its own rank's segments
  (what `partition_batch` does with them), interleaved; the target is 20x.

vLLM is not in the main venv: `rows()` runs this file in .venv-vllm (the repository's, or
`$RUNNER_FSM_VLLM_PYTHON`) and reads its SUITE_ROW lines; without it the rows say "not
measured".

    .venv-vllm/bin/python benchmarks/bench_pcp_layout.py --measure
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import Row, Spread, interleaved, verdict

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARGET = 15.0  # vLLM's time / ours on the 512-request batch
FAST_TARGET = 20.0  # vLLM's manager / the manager with fast_pcp_layout installed, realistic step


def realistic_step(total: int = 8192, decodes: int = 256, seed: int = 0):
    """256 decodes (1 in 8 a verify row of 3), then prefills of 256-4096 tokens up to `total`."""
    rng = np.random.default_rng(seed)
    decode_len = np.where(rng.random(decodes) < 1 / 8, 3, 1)
    left, prefills = total - int(decode_len.sum()), []
    while left > 0:
        prefills.append(min(left, int(rng.integers(256, 4097))))
        left -= prefills[-1]
    scheduled = np.concatenate([decode_len, prefills]).astype(np.int64)
    prefilling = np.arange(scheduled.size) >= decodes
    computed = np.where(prefilling, np.where(rng.random(scheduled.size) < 0.5, 0, 512), 1000).astype(np.int64)
    return scheduled, prefilling, computed


def _vllm_inputs(batch):
    scheduled, prefilling, computed = batch
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    return scheduled.astype(np.int32), computed.astype(np.int32), prefilling, qsl


def _manager(pcp: int, cls=None):
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    return (cls or PCPManager)(pcp_world_size=pcp, pcp_rank=0, device=torch.device("cpu"),
                               shard_decode_requests=True, dcp_world_size=1)


def _check_equal(plan, dispatch, mgr, vllm_in) -> None:
    scheduled, computed, prefilling, qsl = vllm_in
    _, per_rank = mgr._build_batch_layout(scheduled, computed, prefilling, qsl)
    assert list(plan.per_rank_num_tokens) == per_rank, "per-rank counts differ from vLLM's"
    assert dispatch == mgr.get_num_tokens_for_dispatch(scheduled, prefilling), "dispatch count differs"
    for ours, theirs in ((plan.padded_gather_idx, mgr._padded_gather_idx), (plan.kv_write_mask, mgr._gathered_kv_write_mask),
                         (plan.hidden_restore_idx, mgr._hidden_restore_idx)):
        assert np.array_equal(ours, theirs.numpy()), "layout differs from vLLM's"


def _callers(batch, pcp: int, native: bool | None = None):
    """(ours, vLLM's) on `batch`: each computes its layout and its dispatch count. `native`:
    the writer of ours (None: the compiled layout where it is built, as `plan_batch` picks).
    Ours writes into one `PlanWorkspace` kept from call to call, as the engine keeps its own."""
    from runner_fsm.pcp.plan import PlanWorkspace, num_tokens_for_dispatch, plan_batch

    mgr, vllm_in = _manager(pcp), _vllm_inputs(batch)
    scheduled, prefilling, computed = batch
    workspace = PlanWorkspace()

    def ours():
        dispatch = num_tokens_for_dispatch(scheduled, prefilling, pcp, chunking="mrv2", native=native)
        return plan_batch(scheduled, prefilling, computed, pcp, chunking="mrv2", workspace=workspace,
                          native=native), dispatch

    def theirs():
        mgr._build_batch_layout(*vllm_in)
        return mgr.get_num_tokens_for_dispatch(vllm_in[0], vllm_in[2])

    return ours, theirs, mgr, vllm_in


def _pair(batch, pcp: int, repeats: int, native: bool | None = None):
    """Times (ours, vLLM's), interleaved, after checking the outputs equal."""
    ours, theirs, mgr, vllm_in = _callers(batch, pcp, native)
    _check_equal(*ours(), mgr, vllm_in)
    small = int(batch[0].sum()) < 50_000
    times = interleaved({"ours": ours, "vllm": theirs}, repeats=repeats, number=20 if small else 1)
    return times["ours"], times["vllm"]


def _back_to_back(batch, pcp: int, calls: int = 10) -> tuple[float, float]:
    """(ours, vLLM's), each alone call after call (caches warm): the best of `calls` each."""
    ours, theirs, _, _ = _callers(batch, pcp)
    best = []
    for fn in (ours, theirs):
        fn()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return best[0], best[1]


def _ratio(ours, theirs) -> Spread:
    return Spread.of([b / a for a, b in zip(ours, theirs)])


def measured_rows(quick: bool) -> list[Row]:
    import sys as _sys

    _sys.path.insert(0, str(HERE))
    from bench_plan import mixed_batch

    repeats = 3 if quick else 7
    rows, batch = [], mixed_batch(512)
    from runner_fsm.pcp import native

    writer = "compiled layout" if native.status()["native"] else f"numpy ({native.status()['reason']})"
    for pcp in (2, 4, 8):
        ours, theirs = _pair(batch, pcp, repeats)
        ratio = _ratio(ours, theirs)
        numpy_ours, numpy_theirs = _pair(batch, pcp, repeats, native=False)
        warm_ours, warm_theirs = _back_to_back(batch, pcp)
        rows.append(Row(
            f"PCP layout vs vLLM MRV2, 512 reqs, P={pcp}", Spread.of(ours).fmt(" ms", 1e3),
            f"vLLM _build_batch_layout + dispatch {Spread.of(theirs).fmt(' ms', 1e3)}",
            f"{ratio.median:.1f}x faster", f">= {TARGET:.0f}x", verdict(ratio.median >= TARGET),
            note=(f"{int(batch[0].sum()):,} tokens; plan_batch(chunking='mrv2', workspace=...) +"
                  " num_tokens_for_dispatch, outputs equal to vLLM's, interleaved in one process; " if pcp == 2 else "")
            + f"written by the {writer}; the numpy writer (native=False) in its own interleaved run:"
            f" {Spread.of(numpy_ours).median * 1e3:.2f} ms, {_ratio(numpy_ours, numpy_theirs).median:.1f}x; "
            + f"back to back (caches warm), best of 10: ours {warm_ours * 1e3:.2f} ms, vLLM's"
            f" {warm_theirs * 1e3:.2f} ms, {warm_theirs / warm_ours:.1f}x"))
    step = realistic_step()
    per_p = {pcp: _pair(step, pcp, repeats) for pcp in (2, 4, 8)}
    ours, theirs = per_p[4]
    detail = "; ".join(f"P={p}: {Spread.of(o).median * 1e6:.0f} us vs {Spread.of(t).median * 1e6:.0f} us"
                       f" ({_ratio(o, t).median:.1f}x)" for p, (o, t) in per_p.items())
    rows.append(Row(
        "PCP layout vs vLLM MRV2, realistic step, P=4", Spread.of(ours).fmt(" us", 1e6),
        f"vLLM {Spread.of(theirs).fmt(' us', 1e6)}", f"{_ratio(ours, theirs).median:.1f}x faster",
        "report ratio and us", "report",
        note=f"8192 tokens: 256 decodes + {step[1].sum()} prefills; {detail}"))
    rows += [_fast_layout_row(step, repeats, pcp) for pcp in (2, 4, 8)]
    return rows


def _fast_layout_row(step, repeats: int, pcp: int) -> Row:
    """MRV2's manager, fast_pcp_layout installed vs not: what a step's partition asks of it."""
    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

    fast, plain, vllm_in = _manager(pcp), _manager(pcp), _vllm_inputs(step)
    description = install_fast_pcp_layout(fast)  # on the instance, as FSMWorker's MRV2 adapter does
    assert description["installed"], description

    def layout_of(mgr):
        segments, per_rank = mgr._build_batch_layout(*vllm_in)
        return list(segments[mgr.pcp_rank]), per_rank, mgr.get_num_tokens_for_dispatch(vllm_in[0], vllm_in[2])

    assert layout_of(fast) == layout_of(plain), "installed layout differs"
    for ours, theirs in ((fast._padded_gather_idx, plain._padded_gather_idx),
                         (fast._gathered_kv_write_mask, plain._gathered_kv_write_mask),
                         (fast._hidden_restore_idx, plain._hidden_restore_idx)):
        assert ours.dtype == theirs.dtype and ours.tolist() == theirs.tolist(), "installed layout differs"
    times = interleaved({"fast": lambda: layout_of(fast), "plain": lambda: layout_of(plain)},
                        repeats=repeats, number=20)
    on, off = Spread.of(times["fast"]), Spread.of(times["plain"])
    ratio = _ratio(times["fast"], times["plain"])
    return Row(
        f"fast_pcp_layout vs vLLM MRV2 manager, realistic step, P={pcp}", f"installed {on.fmt(' us', 1e6)}",
        f"vLLM's {off.fmt(' us', 1e6)}", f"{ratio.median:.1f}x faster", f">= {FAST_TARGET:.0f}x",
        verdict(ratio.median >= FAST_TARGET),
        note=f"{(off.median - on.median) * 1e6:.0f} us saved per step; written by the {description['writer']}"
        + ("; _build_batch_layout + get_num_tokens_for_dispatch + its own rank's RankSegments (rank 0),"
           " outputs equal to vLLM's, interleaved" if pcp == 2 else ""))


def _vllm_python() -> Path | None:
    for candidate in (os.environ.get("RUNNER_FSM_VLLM_PYTHON"), REPO / ".venv-vllm" / "bin" / "python"):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


NAMES = [*(f"PCP layout vs vLLM MRV2, 512 reqs, P={p}" for p in (2, 4, 8)),
         "PCP layout vs vLLM MRV2, realistic step, P=4",
         *(f"fast_pcp_layout vs vLLM MRV2 manager, realistic step, P={p}" for p in (2, 4, 8))]


def rows(quick: bool = False) -> list[Row]:
    """The rows, measured in .venv-vllm; "not measured" where vLLM is not installed."""
    python = _vllm_python()
    if python is None:
        return [Row(name, "-", "-", "-", "-", "n/a", note="not measured: no .venv-vllm (vLLM not installed)")
                for name in NAMES]
    cmd = [str(python), str(HERE / "bench_pcp_layout.py"), "--measure", *(["--quick"] if quick else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"bench_pcp_layout in {python} exited {proc.returncode}: {tail}")
    out = []
    for line in proc.stdout.splitlines():
        if line.startswith("SUITE_ROW "):
            fields = json.loads(line[len("SUITE_ROW "):])
            out.append(Row(**{f.name: str(fields.get(f.name, "")) for f in dataclasses.fields(Row)}))
    return out


def main() -> int:
    from common import format_table

    quick = "--quick" in sys.argv
    if "--measure" in sys.argv:  # inside .venv-vllm
        for row in measured_rows(quick):
            print("SUITE_ROW " + json.dumps(dataclasses.asdict(row)), flush=True)
        return 0
    print(format_table(rows(quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
