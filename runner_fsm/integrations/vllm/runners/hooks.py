"""Start-up check of the vLLM internals each runner adapter's DP hooks rely on (no public hook exists).

V1 (`v1_dp`) replaces the module global `vllm.v1.worker.dp_utils._run_ar` and tags the runner's
and the drafter's `_determine_batch_execution_and_padding`; Model Runner V2 (`mrv2_dp`) replaces
the global through which MRV2 dp_utils' `sync_cudagraph_and_dp_padding` makes its collective
inline (0.32: `dist`, for `dist.all_reduce`; 0.33: `get_dp_group`, for its `cpu_all_reduce_`);
faults wrap the runner's and the drafter's dummy runs. None of these is public API, so before
anything is patched each is checked against the installed vLLM, by name, signature and (for the
inline collectives) source: only the tables of the adapter in use, for the installed release
(`DP_HOOKS[adapter.name]`, one table per release: `common/versions.pick`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError
from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.common.schema import installed_version
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
_MRV2_RUNNER = {"vllm.v1.worker.gpu.model_runner": ("GPUModelRunner",)}
_MRV2_METHODS = {"vllm.v1.worker.gpu.model_runner.GPUModelRunner": ("prepare_attn", "prepare_dummy_attn", "_dummy_run")}
MRV2 = DPHooks(  # vLLM 0.32: `dist.all_reduce(tensor, group=group)` on a [6, dp] tensor
    names={"vllm.v1.worker.gpu.dp_utils": ("dist", "sync_cudagraph_and_dp_padding"), **_MRV2_RUNNER},
    methods=_MRV2_METHODS,
    sources=(("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding", "dist.all_reduce(tensor"),),
)
MRV2_0_33 = DPHooks(  # vLLM 0.33: `get_dp_group().cpu_all_reduce_(tensor)` on a [7, dp] tensor
    names={"vllm.v1.worker.gpu.dp_utils": ("get_dp_group", "sync_cudagraph_and_dp_padding"), **_MRV2_RUNNER},
    methods={**_MRV2_METHODS, "vllm.distributed.parallel_state.GroupCoordinator": ("cpu_all_reduce_",)},
    sources=(("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding", "get_dp_group().cpu_all_reduce_(tensor)"),),
)
# adapter -> release -> its hooks' table (`versions.pick` chooses by the installed release)
DP_HOOKS: dict[str, dict[str, DPHooks]] = {
    "v1": {"0.32.0": V1},
    "mrv2": {"0.32.0": MRV2, "0.33.0": MRV2_0_33},
    "ascend-mrv2": {"0.32.0": MRV2, "0.33.0": MRV2_0_33},
}


def hooks_for(adapter_name: str, version: str | None = None) -> DPHooks:
    """The DP hooks' table of `adapter_name` for `version` (default: the installed vLLM)."""
    return versions.pick(DP_HOOKS[adapter_name], installed_version() if version is None else version)


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
    version = installed_version()
    problems = find_problems(hooks_for(adapter_name, version))
    if problems:
        raise VLLMSchemaError(f"the DP support of FSMWorker ({adapter_name} runner) was checked against vLLM"
                              f" {', '.join(versions.KNOWN)}; the installed vLLM {version} does not match"
                              f" {versions.release(version)}'s table: " + "; ".join(problems))
