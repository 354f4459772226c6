"""A defect of vLLM 0.32 itself, held here so that its fix is noticed: Model Runner V2's
draft-model speculator (`standalone_ar`) cannot run under data parallelism.

Its draft prefill runs the target's tokens plus one correction token per request, but hands
the forward context the target's DP token counts (`num_tokens_across_dp`), so vLLM's own
`DPMetadata.make` asserts (`AssertionError: 63 64`) in the busy replica's first draft pass.
FSMWorker changes no count here; vLLM's default CPU worker cannot run DP with an MoE model at
all, so this runs through FSMWorker, and the failure must come from those two vLLM frames.
This is why the MRV2 leg runs its DP and fault cases without a drafter. The children run MRV2
whichever leg runs this test (their environment says so), hence it runs once.
"""

from __future__ import annotations

import pytest
import vllm_dp_cases as c
from vllm_checks import mrv2_env

from runner_fsm.integrations.vllm.offline_dp import Job

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def test_mrv2_draft_model_speculator_fails_under_dp_in_vllm_itself(tmp_path):
    models = c.make_models(tmp_path / "models")
    run_dir = tmp_path / "run"
    job = Job(c.kwargs(models, "mixtral", drafting=True, run_dir=str(run_dir), executor=c.VLLM_DEFAULT_LAYOUT), c.PER_RANK)
    result = c.run([job], 2, tmp_path, timeout_s=600, env=mrv2_env())
    assert all(code not in (0, None) for code in result.codes), result.codes
    busy = result.logs[0]
    assert "Using V2 Model Runner" in busy
    assert "spec_decode/standalone_ar/speculator.py" in busy and "in _prefill" in busy, busy[-3000:]
    assert "forward_context.py" in busy and "AssertionError" in busy, busy[-3000:]
    # FSMWorker logged the step the drafter broke in, on the busy replica, as a fault
    faults = [r for r in c.records(run_dir / "rank-0.jsonl") if r["event"] == "fault"]
    assert faults and faults[0]["error"] == "AssertionError", faults
