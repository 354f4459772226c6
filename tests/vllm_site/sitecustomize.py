"""Test set-up only (never imported by the package): found as `sitecustomize` by every Python
process whose PYTHONPATH holds this folder (the vLLM tiers' pytest, the tests' DP children, vLLM's
engine-core and worker processes, the HTTP server). Each part acts only where its environment
asks for it:

- `runner_fsm_test_triton`: Model Runner V2 on this CPU (`VLLM_USE_V2_MODEL_RUNNER=1`,
  `TRITON_INTERPRET=1`: the MRV2 and device legs);
- `runner_fsm_test_start_method`: vLLM's own start method for the processes it starts, in place
  of the `spawn` its CPU platform imposes (`RUNNER_FSM_TEST_START_METHOD=vllm`: every vLLM tier).
"""

import runner_fsm_test_start_method  # noqa: F401
import runner_fsm_test_triton  # noqa: F401
