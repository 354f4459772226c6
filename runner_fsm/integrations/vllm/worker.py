"""`FSMWorker`: vLLM's scheduler, KV-cache manager and DP coordinator drive a replica state machine.

vLLM calls a worker in this order, and each call maps onto the runner:

| vLLM call                          | FSMWorker                                                    |
|------------------------------------|--------------------------------------------------------------|
| `__init__`                         | schema check against the installed vLLM, refuse unsupported config |
| `init_device`                      | vLLM's distributed init; its gloo groups become the runner's |
| `load_model`                       | the runner's Mixtral (and draft) model; never vLLM's loader  |
| `get_kv_cache_spec`                | one full-attention spec per target layer                     |
| `determine_available_memory`       | the KV budget (see `kv.py`)                                  |
| `initialize_from_config`           | caches of vLLM's `num_blocks`; replica, audit log, event loop |
| `compile_or_warm_up_model`         | `Capture` (graphs under FULL_DECODE_ONLY), then `ready`      |
| `execute_model` / `sample_tokens`  | `RealStep` (prefill or decode [+ draft_sync]); tokens back   |
| `execute_dummy_batch`              | `DummyStep`: the `idle_dummy` transition                     |
| `take_draft_token_ids`             | the drafter's proposals of the last step                     |
| `check_health` / `shutdown`        | the runner's fault, if any / `Shutdown`, flush the log       |
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from runner_fsm import dp
from runner_fsm.audit import AuditLog
from runner_fsm.collectives import CollectiveRunner
from runner_fsm.errors import BatchError, RunnerError
from runner_fsm.events import Capture, DummyStep, Fault, RealStep, Shutdown
from runner_fsm.integrations.vllm import kv
from runner_fsm.integrations.vllm.admission import check_request
from runner_fsm.integrations.vllm.errors import UnsupportedFeatureError
from runner_fsm.integrations.vllm.groups import shared_run_dir, vllm_process_groups
from runner_fsm.integrations.vllm.loop import RunnerLoop
from runner_fsm.integrations.vllm.options import (
    WorkerOptions, check_supported, layout_of, num_speculative_tokens, runner_config,
)
from runner_fsm.integrations.vllm.requests import RequestTable
from runner_fsm.integrations.vllm.schema import check_schema
from runner_fsm.model import UnsupportedModelError, load_drafter, load_model, model_groups
from runner_fsm.model.hf_config import MixtralConfig
from runner_fsm.replica import Replica, StepOutput
from runner_fsm.runner import ReplicaRunner
from runner_fsm.states import State
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase


class FSMWorker(WorkerBase):
    """A vLLM worker whose every step is a transition of the runner's replica state machine."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        check_schema(type(self))
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        check_supported(vllm_config)
        self.options = WorkerOptions.from_vllm(vllm_config)
        self.layout = layout_of(vllm_config)
        self.dp_rank = int(self.parallel_config.data_parallel_rank)
        self.num_speculative_tokens = num_speculative_tokens(vllm_config)
        self.table = RequestTable(drafting=self.num_speculative_tokens > 0, admit=check_request)
        self.groups = None
        self.run_dir: str | None = None
        self.model = self.drafter = None
        self.num_kv_blocks = 0
        self.loop: RunnerLoop | None = None
        self.runner: ReplicaRunner | None = None
        self._pending: ModelRunnerOutput | None = None
        self._drafts: DraftTokenIds | None = None

    # -- start-up, in vLLM's order ------------------------------------------------------

    def init_device(self) -> None:
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        kind = self.device_config.device_type
        if kind == "cpu":
            self.device = torch.device("cpu")
            init = self.distributed_init_method  # what vLLM's CPU worker keys its shm groups by
            os.environ["VLLM_DIST_IDENT"] = (os.path.basename(init.removeprefix("file://"))
                                             if init.startswith("file://") else init.split(":")[-1])
        elif kind == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
        else:
            raise UnsupportedFeatureError(f"FSMWorker runs on cpu or cuda devices, not {kind!r}")
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        self.groups = vllm_process_groups(self.layout, self.dp_rank)
        self.run_dir = shared_run_dir(self.options.run_dir, self.groups)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise UnsupportedFeatureError("FSMWorker loads real checkpoints only (load_format='dummy' asked for)")
        target_dir = _model_dir(self.model_config.model, "model")
        cfg = _mixtral_config(target_dir, "model")
        groups = model_groups(self.groups, self.device)
        kw = dict(kv_num_blocks=1, block_size=int(self.cache_config.block_size), groups=groups,
                  device=self.device, dtype=self.model_config.dtype)
        self.model = load_model(target_dir, **kw)  # the cache is resized once vLLM sizes it
        if self.num_speculative_tokens > 0:
            draft_dir = _model_dir(self.speculative_config.draft_model_config.model, "draft model")
            _mixtral_config(draft_dir, "draft model")
            self.drafter = load_drafter(draft_dir, target_vocab_size=cfg.vocab_size, **kw)

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return kv.kv_cache_spec(self.model.cfg, int(self.cache_config.block_size), self.model_config.dtype)

    def determine_available_memory(self) -> int:
        draft = self.drafter.decoder.cfg if self.drafter is not None else None
        return kv.kv_budget_bytes(self.vllm_config, self.model.cfg, draft, self.model_config.dtype, self.device)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The pre-0.11 sizing call (vLLM 0.32 sizes through `initialize_from_config`)."""
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise UnsupportedFeatureError(f"vLLM built {len(groups)} KV cache groups; the runner's"
                                          f" model has one (full attention in every layer)")
        block_size = int(groups[0].kv_cache_spec.block_size)
        self.num_kv_blocks = int(kv_cache_config.num_blocks)
        self.cache_config.num_gpu_blocks = self.num_kv_blocks
        kv.install_caches(self.model, self.drafter, self.num_kv_blocks, block_size)
        config = runner_config(self.vllm_config, self.options, block_size)
        self.loop = RunnerLoop()
        self.runner = self.loop.call(self._build_runner, config)

    def _build_runner(self, config) -> ReplicaRunner:
        pcp_rank = self.groups.pcp_rank if self.groups is not None else 0
        global_rank = self.layout.global_rank(self.dp_rank, pcp_rank)
        run_id = self.options.run_id or Path(self.run_dir).name
        audit = AuditLog(self.run_dir, run_id, global_rank, self.dp_rank, pcp_rank)
        agreement = (dp.GlooAgreement(self.groups.dp, config.capture_sizes) if self.groups is not None
                     else dp.SingleReplicaAgreement(config.capture_sizes))
        replica = Replica(config, dp_rank=self.dp_rank, pcp_rank=pcp_rank, model=self.model,
                          drafter=self.drafter, agreement=agreement, audit=audit,
                          collectives=CollectiveRunner(audit, config.collective_timeout_s),
                          device=self.device)
        return ReplicaRunner(replica)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.loop.call(self.runner.handle, Capture())
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # -- steps --------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        so = scheduler_output
        try:
            if so.kv_cache_block_copies:
                kv.copy_blocks(self._caches(), so.kv_cache_block_copies)
            self.table.update(so)
            if not so.total_num_scheduled_tokens:
                if self.parallel_config.distributed_executor_backend == "external_launcher" and self.layout.dp_size > 1:
                    self.execute_dummy_batch()  # vLLM's rule: its peers still expect this step
                return EMPTY_MODEL_RUNNER_OUTPUT
            plan = self.table.plan(so)
        except RunnerError as error:
            self.loop.call(self._fail, error)
            raise
        out: StepOutput = self.loop.call(self.runner.handle, RealStep(plan.batch))
        tokens = self.table.commit(plan, out.sampled)
        req_ids = list(plan.batch.req_ids)
        self._pending = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=tokens)
        if self.num_speculative_tokens > 0:
            kept = [r for r, emits in zip(req_ids, plan.emits) if emits]
            self._drafts = DraftTokenIds(kept, [list(out.drafts.get(r, ())) for r in kept])
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        if grammar_output is not None and getattr(grammar_output, "structured_output_request_ids", None):
            raise UnsupportedFeatureError("FSMWorker does not apply grammar bitmasks (structured outputs)")
        out, self._pending = self._pending, None
        if out is None:
            raise RuntimeError("sample_tokens called without a step from execute_model before it")
        return out

    def execute_dummy_batch(self) -> None:
        self.loop.call(self.runner.handle, DummyStep(pending=len(self.table)))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    async def _fail(self, error: BaseException) -> None:
        """A step that failed before reaching the replica: stop DP peers, fault, log the cause."""
        if self.runner is None or self.runner.ended_reason is not None:
            return
        if self.layout.dp_size > 1:
            status = dp.STATUS_BATCH_ERROR if isinstance(error, BatchError) else dp.STATUS_FAULT
            await self.runner.replica.abort_peers(status)
        await self.runner.handle(Fault(error))

    def _caches(self) -> list:
        caches = [self.model.cache]
        if self.drafter is not None:
            caches.append(self.drafter.cache)
        return caches

    # -- health and the end -------------------------------------------------------------

    def check_health(self) -> None:
        runner = self.runner
        if runner is not None and runner.machine.state is State.FAULTED:
            raise RuntimeError(f"FSMWorker replica {self.dp_rank}: {runner.ended_reason}")

    def shutdown(self) -> None:
        runner, loop = self.runner, self.loop
        self.runner = None
        if runner is None or loop is None or loop.closed:
            return
        try:
            if runner.ended_reason is None:
                loop.call(runner.handle, Shutdown("vLLM shut the worker down"))
        finally:
            loop.call(runner.close)
            loop.close()

    # -- the rest of the worker interface -----------------------------------------------

    def get_model(self) -> Any:
        return self.model

    def get_cache_block_size_bytes(self) -> int:
        return kv.bytes_per_token(self.model.cfg, self.model_config.dtype) * int(self.cache_config.block_size)

    def reset_encoder_cache(self) -> None:
        return None


def _model_dir(name: str, what: str) -> str:
    if not Path(name).is_dir():
        raise UnsupportedFeatureError(f"FSMWorker loads a local {what} directory; {name!r} is not one"
                                      f" (download it first, e.g. `hf download {name} --local-dir DIR`)")
    return str(name)


def _mixtral_config(model_dir: str, what: str) -> MixtralConfig:
    try:
        return MixtralConfig.from_dir(model_dir)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"FSMWorker cannot load the {what} at {model_dir}: {exc}. FSMWorker runs runner_fsm's own"
            f" reference model, so it serves MixtralForCausalLM checkpoints only; serve other"
            f" architectures with vLLM's default worker (drop worker_cls)") from None
