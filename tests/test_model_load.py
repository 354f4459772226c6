"""A rank reads only the weights it keeps: peak memory while loading, against the checkpoint.

A ~60 MB checkpoint whose experts are most of it. Peak RSS above the RSS before loading
(VmHWM after `/proc/self/clear_refs` = 5), with every kept byte touched inside the span:
one rank of one <= 1.2x the checkpoint; a rank of four (expert-parallel width 4) <= 0.5x.
The whole-checkpoint read that loaders did before is measured alongside and must exceed both,
so the test can tell the two loaders apart.
"""

from __future__ import annotations

import ctypes
import gc

import torch

from runner_fsm.model import load_model, make_random_model
from runner_fsm.model_files.hf_config import MixtralConfig
from runner_fsm.model_files.make import ModelSpec
from runner_fsm.model.parallel import ModelGroups
from runner_fsm.model_files.weights import bind_weights, read_checkpoint

SPEC = ModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, experts=8, intermediate=1024, vocab=4096)


def _status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def _release_freed_memory() -> None:
    """Freed heap memory stays resident (glibc keeps it; after a big free it also raises its mmap
    threshold, so the next big buffers come from that heap): a later load reusing those pages
    would not raise RSS, and its peak would read low. Return them to the kernel first."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak(fn) -> int:
    _release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    weights = fn()
    tensors = [weights.embed, weights.lm_head] + [t for layer in weights.layers for t in (
        layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.router,
        *(w for e in layer.experts.values() for w in (e.w1, e.w2, e.w3)))]
    assert sum(float(t.sum()) for t in tensors) != 0.0  # touch every kept byte
    peak = _status("VmHWM") - before
    del weights, tensors
    return peak


def test_peak_rss_of_a_rank_is_what_it_keeps(tmp_path):
    make_random_model(tmp_path, SPEC, seed=0)
    size = (tmp_path / "model.safetensors").stat().st_size
    assert 50e6 < size < 80e6

    def lazy(rank, world):
        groups = ModelGroups(global_rank=rank, world_size=world, pcp_rank=rank % 2, pcp_size=min(world, 2))
        return lambda: load_model(tmp_path, kv_num_blocks=1, block_size=16, groups=groups).decoder.weights

    def whole():
        return bind_weights(MixtralConfig.from_dir(tmp_path), read_checkpoint(tmp_path), rank=0, world_size=4,
                            device=torch.device("cpu"), dtype=torch.float32)

    one, of_four, old = _peak(lazy(0, 1)), _peak(lazy(1, 4)), _peak(whole)
    assert one <= 1.2 * size, f"one rank peaked at {one / size:.2f}x the checkpoint"
    assert of_four <= 0.5 * size, f"a rank of four peaked at {of_four / size:.2f}x the checkpoint"
    assert old > 1.2 * size, f"the whole-checkpoint read peaked at only {old / size:.2f}x"
