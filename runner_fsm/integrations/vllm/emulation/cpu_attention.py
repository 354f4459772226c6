"""What vLLM's CPU attention backend computes on the host when it builds metadata, refreshed
before each emulated replay.

`CPUAttentionMetadataBuilder.build` computes `scheduler_metadata` (the kernel's work split)
on the host from `seq_lens` and `query_start_loc`. A graph captured on a device holds device
buffers only, which the runner rewrites every step; a metadata object frozen at capture would
hold the capture batch's split for ever (wrong tokens). So each metadata object built while a
graph's forward is made is kept with how to rebuild its split, and rebuilt, from the same
persistent `seq_lens` and `query_start_loc` the kernel reads, right before each replay. The
other host fields (`num_actual_tokens`, `max_query_len`, `max_seq_len`, `causal`) are the
padded graph's, as a device capture freezes them, and the kernel does not size work by them.

The builder also declares no graph support (`_cudagraph_support` NEVER, because of that host
field): with the refresh, the emulation declares what the CUDA backends declare for uniform
decode batches. Other backends (MLA on the CPU) are not emulated: vLLM refuses their graphs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

BUILDER = "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder"
MLA_BACKEND = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
_collecting = threading.local()  # .built: the refreshers of metadata built by the forward being made


@contextlib.contextmanager
def collect() -> Iterator[list[Callable[[], None]]]:
    """The refreshers of every CPU attention metadata built inside the block."""
    outer = getattr(_collecting, "built", None)
    _collecting.built = built = []
    try:
        yield built
    finally:
        _collecting.built = outer


def install() -> str:
    """Wrap the builder's `build` (once per process); returns what was done, for the job record."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends import cpu_attn

    builder = cpu_attn.CPUAttentionMetadataBuilder
    if getattr(builder.build, "_runner_fsm_emulation", False):
        return "installed"
    build = builder.build

    @functools.wraps(build)
    def build_and_keep(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False):
        metadata = build(self, common_prefix_len, common_attn_metadata, fast_build)
        built = getattr(_collecting, "built", None)
        if built is not None and metadata.scheduler_metadata is not None:
            built.append(_refresher(self, metadata, common_attn_metadata.num_reqs))
        return metadata

    build_and_keep._runner_fsm_emulation = True
    builder.build = build_and_keep
    builder._cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    _install_mla()
    return "installed"


def _install_mla() -> None:
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    common = CPUMLABackend.get_builder_cls()
    graphed = type(f"Emulated{common.__name__}", (common,), {
        "_cudagraph_support": AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "__module__": __name__,
        "__doc__": "vLLM's MLA builder, for the CPU MLA backend in the device emulation (see the module)."})
    CPUMLABackend.get_builder_cls = staticmethod(lambda: graphed)


def _refresher(builder: Any, metadata: Any, num_reqs: int) -> Callable[[], None]:
    """Rebuild `metadata.scheduler_metadata` as `build` does, from its persistent tensors now."""
    from vllm import _custom_ops as ops, envs

    def refresh() -> None:
        metadata.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs, num_heads=builder.num_heads, num_kv_heads=builder.num_kv_heads,
            head_dim=builder.head_dim, seq_lens=metadata.seq_lens, dtype=builder.dtype,
            query_start_loc=metadata.query_start_loc, causal=metadata.causal,
            sliding_window_size=builder.window_size, isa=builder.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=metadata.dynamic_causal, kv_cache_dtype=builder.kv_cache_dtype)
    return refresh
