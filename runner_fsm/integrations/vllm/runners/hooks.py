"""Start-up check of the vLLM internals each runner adapter's DP hooks rely on (no public hook exists).

V1 (`v1_dp`) replaces the module global `vllm.v1.worker.dp_utils._run_ar` and tags the runner's
and the drafter's `_determine_batch_execution_and_padding`; Model Runner V2 (`mrv2_dp`) replaces
MRV2 dp_utils' `dist`, whose `all_reduce` `sync_cudagraph_and_dp_padding` calls inline; faults
wrap the runner's and the drafter's dummy runs. None of these is public API, so before anything is
patched each is checked against the installed vLLM, by name, signature and (for the inline
collectives) source: only the tables of the adapter in use (`DP_HOOKS[adapter.name]`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError
from runner_fsm.integrations.vllm.common.schema import WRITTEN_AGAINST, installed_version
from runner_fsm.integrations.vllm.runners.v1_dp import RUN_AR_PARAMS


@dataclasses.dataclass(frozen=True)
class DPHooks:
    """What one adapter's DP hooks read of vLLM: `names` (module -> names in it), `methods`
    (class path -> methods), `sources` ((module, function, text its source must contain): the
    collective is made where the hook expects it), `signatures` (function path -> parameters)."""

    names: dict[str, tuple[str, ...]]
    methods: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    sources: tuple[tuple[str, str, str], ...] = ()
    signatures: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


V1 = DPHooks(
    names={"vllm.v1.worker.dp_utils": ("_run_ar", "_get_device_and_group", "_post_process_cudagraph_mode",
                                       "_post_process_ubatch", "_post_process_dp_padding", "_synchronize_dp_ranks",
                                       "coordinate_batch_across_dp"),
           "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner",),
           "vllm.v1.spec_decode.llm_base_proposer": ("SpecDecodeBaseProposer",)},
    methods={"vllm.v1.worker.gpu_model_runner.GPUModelRunner": ("_determine_batch_execution_and_padding", "_dummy_run"),
             "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer": (
                 "_determine_batch_execution_and_padding", "dummy_run")},
    sources=(("vllm.v1.worker.dp_utils", "_synchronize_dp_ranks", "_run_ar("),),
    signatures={"vllm.v1.worker.dp_utils._run_ar": RUN_AR_PARAMS},
)
MRV2 = DPHooks(
    names={"vllm.v1.worker.gpu.dp_utils": ("dist", "sync_cudagraph_and_dp_padding"),
           "vllm.v1.worker.gpu.model_runner": ("GPUModelRunner",)},
    methods={"vllm.v1.worker.gpu.model_runner.GPUModelRunner": ("prepare_attn", "prepare_dummy_attn", "_dummy_run")},
    sources=(("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding", "dist.all_reduce(tensor"),),
)
DP_HOOKS = {"v1": V1, "mrv2": MRV2, "ascend-mrv2": MRV2}


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def find_problems(hooks: DPHooks) -> list[str]:
    """Every name, signature and source text of `hooks` the installed vLLM lacks."""
    problems = []
    for module, names in hooks.names.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{module} does not import ({exc})")
            continue
        problems += [f"{module}.{name} is missing" for name in names if not hasattr(mod, name)]
    for path, methods in hooks.methods.items():
        try:
            cls = _resolve(path)
        except (ImportError, AttributeError):
            continue  # named by `names`
        problems += [f"{cls.__name__}.{m} is missing" for m in methods if not hasattr(cls, m)]
    for path, params in hooks.signatures.items():
        try:
            have = tuple(inspect.signature(_resolve(path)).parameters)
        except (ImportError, AttributeError):
            continue
        if have != params:
            problems.append(f"{path} takes {list(have)}, the replacement {list(params)}")
    for module, function, text in hooks.sources:
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), function))
        except (ImportError, AttributeError, OSError) as exc:
            problems.append(f"{module}.{function} unreadable ({exc})")
            continue
        if text not in source:
            problems.append(f"{module}.{function} no longer calls {text!r}")
    return problems


def check_dp_hooks(adapter_name: str) -> None:
    """Raise `VLLMSchemaError` naming every problem of the DP hooks of the adapter `adapter_name`."""
    problems = find_problems(DP_HOOKS[adapter_name])
    if problems:
        raise VLLMSchemaError(f"the DP support of FSMWorker ({adapter_name} runner) was written against vLLM"
                              f" {WRITTEN_AGAINST}; the installed vLLM {installed_version()} does not match it: "
                              + "; ".join(problems))
