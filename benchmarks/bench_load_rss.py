"""Peak memory of one rank while it loads its weights, against the checkpoint's size.

A ~216 MB float32 checkpoint (LOAD_SPEC: experts are 81% of it, as in a real MoE). Each rank
resets its peak-RSS counter (`/proc/self/clear_refs` = 5), loads, and reports VmHWM minus its
RSS before loading (the interpreter, torch and the process groups are there before any
weight is read, and are not the loader's). Two layouts, each one `spawn` job:
- DP=1 x PCP=1 (one rank, every expert): target <= 1.2x the checkpoint;
- DP=2 x PCP=2 (4 ranks, expert-parallel width 4): target <= 0.5x the checkpoint per rank.
Per rank both loaders run, in separate processes: `load_model` (lazy: `safe_open` headers,
only the kept tensors read) and the whole-checkpoint read that loaders did before
(`read_checkpoint` then `bind_weights`), the baseline of the same run.
Every kept byte is read inside the measured span (a lazily read tensor costs nothing until
touched), and both loaders' weights must agree.

    .venv/bin/python benchmarks/bench_load_rss.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import Row, verdict

LAYOUTS = ((1, 1), (2, 2))
TARGETS = {1: 1.2, 4: 0.5}  # world size -> peak / checkpoint


def load_spec():
    from runner_fsm.model_files.make import ModelSpec

    return ModelSpec(layers=2, hidden=512, heads=8, kv_heads=4, experts=8, top_k=2, vocab=8192,
                     intermediate=1792)


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_while(fn) -> tuple[int, object]:
    """Peak RSS above the RSS before `fn` runs, in bytes, and `fn`'s result."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    before = _status("VmRSS")
    result = fn()
    return _status("VmHWM") - before, result


def _load(model_dir: str, mg, how: str):
    import torch

    from runner_fsm.model import load_model
    from runner_fsm.model_files.hf_config import MixtralConfig
    from runner_fsm.model_files.weights import bind_weights, read_checkpoint

    if how == "lazy":
        return load_model(model_dir, kv_num_blocks=1, block_size=16, groups=mg).decoder.weights
    cfg = MixtralConfig.from_dir(model_dir)
    return bind_weights(cfg, read_checkpoint(model_dir), rank=mg.global_rank, world_size=mg.world_size,
                        device=torch.device("cpu"), dtype=torch.float32)


def _rank_main(groups, model_dir: str, how: str) -> dict:
    import torch

    from runner_fsm.model.parallel import ModelGroups

    mg = ModelGroups(global_rank=groups.global_rank, world_size=groups.layout.world_size,
                     pcp_rank=groups.pcp_rank, pcp_size=groups.layout.pcp_size)
    torch.set_num_threads(1)
    peak, (weights, digest) = peak_while(lambda: _touched(_load(model_dir, mg, how)))
    experts = sorted(e for e in weights.layers[0].experts)
    return {"rank": groups.global_rank, "peak": peak, "digest": digest, "experts": experts}


def _touched(weights):
    """Read every byte a rank keeps: lazily read weights are only counted once touched."""
    tensors = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [layer.input_norm, layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj,
                    layer.post_norm, layer.router]
        tensors += [t for e in layer.experts.values() for t in (e.w1, e.w2, e.w3)]
    return weights, sum(float(t.sum()) for t in tensors)


def measure() -> dict:
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.launch import spawn
    from runner_fsm.model import make_random_model

    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as root:
        model_dir = str(Path(root) / "model")
        make_random_model(model_dir, load_spec(), seed=0)
        size = (Path(model_dir) / "model.safetensors").stat().st_size
        for dp, pcp in LAYOUTS:
            runs = {how: spawn(_rank_main, ParallelLayout(dp, pcp), model_dir, how, timeout_s=300)
                    for how in ("lazy", "whole")}
            for a, b in zip(runs["lazy"], runs["whole"]):
                assert a["digest"] == b["digest"] and a["experts"] == b["experts"], \
                    f"rank {a['rank']}: the two loaders kept different weights"
            out[dp * pcp] = {how: [r["peak"] for r in res] for how, res in runs.items()}
    return {"size": size, "worlds": out}


def rows(quick: bool = False) -> list[Row]:
    res = measure()
    size = res["size"]
    out = []
    for world, peaks in sorted(res["worlds"].items()):
        lazy, whole = max(peaks["lazy"]), max(peaks["whole"])
        target = TARGETS[world]
        layout = "DP=1 x PCP=1" if world == 1 else "DP=2 x PCP=2 (expert width 4)"
        out.append(Row(
            f"peak RSS of a rank loading {size / 1e6:.0f} MB, {layout}", f"{lazy / size:.2f}x ckpt",
            f"whole-checkpoint read {whole / size:.2f}x", f"{whole / lazy:.2f}x less",
            f"<= {target}x ckpt", verdict(lazy <= target * size),
            note=f"per rank (MB above RSS before loading): lazy {[round(p / 1e6) for p in peaks['lazy']]},"
                 f" whole read {[round(p / 1e6) for p in peaks['whole']]}; VmHWM after clear_refs"))
    return out


def main() -> int:
    from common import format_table

    print(format_table(rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
