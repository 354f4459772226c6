"""vLLM-Ascend's NPU model runner v2 (`vllm_ascend/worker/v2/model_runner.py`, `NPUModelRunner`).

It subclasses vLLM's Model Runner V2 and keeps the parts the MRV2 adapter relies on:
`prepare_attn` and `prepare_dummy_attn` (inherited), `_dummy_run` (what `NPUWorker.
execute_dummy_batch` calls), `input_buffers` (`AscendInputBuffers`, re-made in its
constructor), `speculator`, and vLLM's `dispatch_cg_and_sync_dp` as its one DP sync. Written
against vLLM-Ascend's source (see `SOURCE_PIN`; `tests/test_vllm_ascend_source.py` finds every
name there); never run here: `torch_npu` needs Ascend's CANN.
"""

from __future__ import annotations

from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner

# The released source the names were checked against (PyPI sdist) and the git commit read for
# the PCP-for-DP work ("Adapt PCP for data parallelism", AscendPCPManager), newer than any release.
SOURCE_PIN = "vllm-ascend==0.23.0.post1"
GIT_READ = "182b75ea84ff13ece27b57391331ef8935410aea"


class AscendMRV2Runner(MRV2Runner):
    name = "ascend-mrv2"
    CLASSES = ("vllm_ascend.worker.v2.model_runner.NPUModelRunner",)
