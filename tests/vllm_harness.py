"""Run one workload through vLLM (FSMWorker or vLLM's own worker), in this process: test set-up.

Shared by the `vllm` test tier and `benchmarks/bench_vllm_worker.py`, so both compare the
same requests under the same engine settings. A request (`Req`) and how it is generated are
the offline DP launcher's (`runner_fsm.integrations.vllm.offline_dp`), which users run too.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from runner_fsm.integrations.vllm.offline_dp import Req, close_llm, generate, sampling

__all__ = ["FSM_WORKER", "Req", "close_llm", "generate", "llm_kwargs", "mixed_workload", "open_llm", "sampling",
           "worker_call"]

FSM_WORKER = "runner_fsm.integrations.vllm.FSMWorker"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process


def mixed_workload(vocab: int = 512, *, num: int = 12, seed: int = 0, long_prompt: int = 90,
                   seeded: bool = False) -> list[Req]:
    """Short prompts and one long one (chunked when it exceeds a step's budget), finishing at
    different steps; `seeded`: every request samples with its own seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        length = long_prompt if i == 0 else int(rng.integers(3, 40))
        prompt = tuple(int(t) for t in rng.integers(3, vocab, length))
        out.append(Req(f"r{i}", prompt, int(rng.integers(2, 14)), 1000 + i if seeded else None))
    return out


def llm_kwargs(model_dir: str, *, worker: str | None = FSM_WORKER, run_dir: str | None = None,
               block_size: int = 32, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
               max_model_len: int = 512, num_gpu_blocks: int | None = None,
               kv_cache_memory_bytes: int = 64 << 20, draft_dir: str | None = None, k: int = 0,
               runner_fsm: dict | None = None, **extra: Any) -> dict:
    """`LLM(...)` arguments: float32, eager, small limits for a 2-core machine."""
    kw: dict[str, Any] = dict(
        model=model_dir, dtype="float32", enforce_eager=True, seed=0, block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
    )
    if num_gpu_blocks is not None:
        kw["num_gpu_blocks_override"] = num_gpu_blocks
    if worker is not None:
        kw["worker_cls"] = worker
        options = dict(runner_fsm or {})
        if run_dir is not None:
            options["run_dir"] = run_dir
        kw["additional_config"] = {"runner_fsm": options}
    if k:
        kw["speculative_config"] = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}
    if "attention_backend" not in extra and _mla_on_the_cpu(model_dir):
        kw["attention_backend"] = "CPU_MLA"
    kw.update(extra)
    return kw


def _mla_on_the_cpu(model_dir: str) -> bool:
    """An MLA model (its config has `kv_lora_rank`) on vLLM's CPU platform. There vLLM 0.32 picks
    its AMX MLA backend wherever the CPU has AMX tiles, and that backend packs only bfloat16,
    float16 or int8 weights: the float32 test models failed to load ("expect weight to be
    bfloat16, float16, int8, ...") on a host with AMX, every MLA test with them. On hosts without
    AMX vLLM picks the reference CPU_MLA backend; asked for by name, every host runs that one."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not config.get("kv_lora_rank"):
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def open_llm(**kwargs: Any) -> Iterator[Any]:
    """An in-process `vllm.LLM`, shut down (worker logs closed, groups destroyed) on exit."""
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        close_llm(llm)


def worker_call(llm: Any, fn) -> list:
    """`fn(worker)` on every worker of `llm` (vLLM's collective_rpc with a callable)."""
    return llm.collective_rpc(fn)
