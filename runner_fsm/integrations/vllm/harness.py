"""Run one greedy workload through vLLM (FSMWorker or vLLM's own worker) or the embedded engine.

Shared by the `vllm` test tier and `benchmarks/bench_vllm_worker.py`, so both compare the
same requests under the same engine settings. Requests are the embedded engine's `Request`;
through vLLM each becomes a token-id prompt with `temperature=0, ignore_eos=True,
max_tokens=max_new_tokens`, which is exactly what the embedded engine computes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Iterator, Sequence

from runner_fsm.engine.requests import Request

FSM_WORKER = "runner_fsm.integrations.vllm.FSMWorker"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process


def mixed_workload(vocab: int = 512, *, num: int = 12, seed: int = 0, long_prompt: int = 90) -> list[Request]:
    """Short and long prompts (one longer than a step's token budget) finishing at different steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        length = long_prompt if i == 0 else int(rng.integers(3, 40))
        prompt = tuple(int(t) for t in rng.integers(3, vocab, length))
        out.append(Request(f"r{i}", prompt, int(rng.integers(2, 14))))
    return out


def llm_kwargs(model_dir: str, *, worker: str | None = FSM_WORKER, run_dir: str | None = None,
               block_size: int = 32, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
               max_model_len: int = 512, num_gpu_blocks: int | None = None,
               kv_cache_memory_bytes: int = 64 << 20, draft_dir: str | None = None, k: int = 0,
               runner_fsm: dict | None = None, **extra: Any) -> dict:
    """`LLM(...)` arguments: float32, eager, greedy-friendly, small limits for a 2-core machine."""
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
    kw.update(extra)
    return kw


@contextlib.contextmanager
def open_llm(**kwargs: Any) -> Iterator[Any]:
    """An in-process `vllm.LLM`, shut down (worker log flushed, groups destroyed) on exit."""
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        close_llm(llm)


def close_llm(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()


def sampling(req: Request):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, ignore_eos=True)


def generate(llm: Any, requests: Sequence[Request]) -> tuple[dict[str, list[int]], float]:
    """Greedy outputs per request id, and the seconds `generate` took."""
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, [sampling(r) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {r.req_id: list(o.outputs[0].token_ids) for r, o in zip(requests, outs)}, elapsed


def worker_call(llm: Any, fn) -> list:
    """`fn(worker)` on every worker of `llm` (vLLM's collective_rpc with a callable)."""
    return llm.collective_rpc(fn)


def embedded_outputs(model_dir: str, requests: Sequence[Request], run_dir: str, **config: Any) -> dict[str, list[int]]:
    """The embedded engine's greedy outputs (one replica, in this process, float32)."""
    from runner_fsm.engine.api import run_engine
    from runner_fsm.engine.config import EngineConfig

    cfg = EngineConfig(model_dir=model_dir, run_dir=run_dir, dtype="float32", **config)
    result = run_engine(cfg, list(requests), in_process=True)
    if not result.ok:
        raise RuntimeError(f"embedded engine failed: {[r.error for r in result.errors]}")
    return result.outputs
