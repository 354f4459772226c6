"""Test set-up only (never imported by the package): lets vLLM's Model Runner V2 run on this CPU.

vLLM uses MRV2 only where Triton works; on the CPU its check (`vllm/triton_utils/importing.py`)
wants a Triton backend named `cpu`, which the installed Triton lacks. With `TRITON_INTERPRET=1`
Triton's interpreter runs MRV2's kernels on CPU tensors and no driver is ever asked to compile,
so a stand-in entry whose driver reports active is all the check needs. With tensor parallelism
vLLM also `torch.compile`s its vocab-parallel masking, and inductor's autotune cache asks the
active driver for its target (`get_current_target()`) and the backend that supports it for a
`hash()`: the stand-in answers a `cpu` target and a fixed hash, and still never compiles a kernel.
Imported by this folder's `sitecustomize`; it acts only when the MRV2 leg's environment is set:
`VLLM_USE_V2_MODEL_RUNNER=1` and `TRITON_INTERPRET=1`.

It also turns off the interpreter's integer-overflow sanitizer while its debug mode is off, for
speed alone: Triton 3.9's interpreter computes each int32 add, sub and mul a second time in int64
with bounds compares and hands the result to `device_assert`, which drops it unless `debug` is
on (`TritonSemantic.device_assert`), so the sanitizer's work is never seen; it was a third of an
MRV2 step's CPU here (each step's kernels are run by the interpreter). Triton has no public option
for the interpreter's `InterpreterOptions`: its module-level builder's options are replaced, on the
version read for this alone; on another version they are left as they are.
"""

import os

if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.backends import Backend, backends
    except ImportError:  # no Triton: vLLM falls back to V1, and the leg's runner check fails
        backends = None
    if backends is not None and "cpu" not in backends:

        from triton.backends.compiler import GPUTarget

        class _InterpreterOnlyDriver:
            """Active, so vLLM's check passes; never used to compile (the interpreter runs)."""

            @staticmethod
            def is_active() -> bool:
                return True

            def get_current_target(self) -> GPUTarget:
                return GPUTarget("cpu", 0, 0)

        class _InterpreterOnlyCompiler:
            """Named by inductor's cache key only (`make_backend(target).hash()`)."""

            def __init__(self, target: GPUTarget) -> None:
                self.target = target

            @staticmethod
            def supports_target(target: GPUTarget) -> bool:
                return target.backend == "cpu"

            def hash(self) -> str:
                return "runner-fsm-triton-interpreter"

        backends["cpu"] = Backend(compiler=_InterpreterOnlyCompiler, driver=_InterpreterOnlyDriver)

    if backends is not None:
        import triton
    if backends is not None and triton.__version__ == "3.9.0":
        import dataclasses

        import triton.runtime.interpreter as _interpreter

        _options = _interpreter.interpreter_builder.options
        if not _options.debug:  # with debug on, its asserts are kept: the sanitizer stays
            _interpreter.interpreter_builder.options = dataclasses.replace(_options, sanitize_overflow=False)
