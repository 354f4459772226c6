"""Start-up check of the vLLM internals the DP support relies on (no public hook exists).

`dp_agreement` replaces the module global `vllm.v1.worker.dp_utils._run_ar` and reads vLLM's
post-processing helpers; `mrv2_sync` replaces MRV2 dp_utils' `dist`; phase tags and faults
wrap the runner's and drafter's private methods; `cpu_collectives` fills two stubs of the
communicator base. None of these is public API, so each is checked against the installed
vLLM, by name, signature and (for the inline collectives) source, before anything is patched.
"""

from __future__ import annotations

import importlib
import inspect

from runner_fsm.integrations.vllm.errors import VLLMSchemaError
from runner_fsm.integrations.vllm.schema import WRITTEN_AGAINST, installed_version

RUN_AR_PARAMS = ("should_ubatch", "orig_num_tokens_per_ubatch", "padded_num_tokens_per_ubatch",
                 "cudagraph_mode", "parallel_config")
# module path -> names that must exist in it
NAMES = {
    "vllm.v1.worker.dp_utils": ("_run_ar", "_get_device_and_group", "_post_process_cudagraph_mode",
                                "_post_process_ubatch", "_post_process_dp_padding", "_synchronize_dp_ranks",
                                "coordinate_batch_across_dp"),
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner",),
    "vllm.v1.spec_decode.llm_base_proposer": ("SpecDecodeBaseProposer",),
    "vllm.distributed.device_communicators.base_device_communicator": ("DeviceCommunicatorBase",),
}
METHODS = {
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": ("_determine_batch_execution_and_padding", "_dummy_run"),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer": (
        "_determine_batch_execution_and_padding", "dummy_run"),
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase": (
        "all_gatherv", "reduce_scatterv"),
}
# (module, function, text its source must contain): the collective is made where we expect it
SOURCES = (
    ("vllm.v1.worker.dp_utils", "_synchronize_dp_ranks", "_run_ar("),
    ("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding", "dist.all_reduce(tensor"),
)


def find_problems(*, mrv2: bool = False) -> list[str]:
    problems = []
    for module, names in NAMES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{module} does not import ({exc})")
            continue
        problems += [f"{module}.{name} is missing" for name in names if not hasattr(mod, name)]
    for path, methods in METHODS.items():
        module, _, cls_name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name, None)
        problems += [f"{cls_name}.{m} is missing" for m in methods if cls is not None and not hasattr(cls, m)]
    try:
        from vllm.v1.worker import dp_utils
        have = tuple(inspect.signature(dp_utils._run_ar).parameters)
        if have != RUN_AR_PARAMS:
            problems.append(f"dp_utils._run_ar takes {list(have)}, the replacement {list(RUN_AR_PARAMS)}")
    except (ImportError, AttributeError):
        pass
    for module, function, text in SOURCES if mrv2 else SOURCES[:1]:
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), function))
        except (ImportError, AttributeError, OSError) as exc:
            problems.append(f"{module}.{function} unreadable ({exc})")
            continue
        if text not in source:
            problems.append(f"{module}.{function} no longer calls {text!r}")
    return problems


def check_dp_hooks(*, mrv2: bool = False) -> None:
    problems = find_problems(mrv2=mrv2)
    if problems:
        raise VLLMSchemaError(f"the DP support of FSMWorker was written against vLLM {WRITTEN_AGAINST}; the"
                              f" installed vLLM {installed_version()} does not match it: " + "; ".join(problems))
