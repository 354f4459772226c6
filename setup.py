"""The build of runner-fsm's three compiled parts (the metadata is in pyproject.toml).

- `runner_fsm/pcp/_mrv2_layout.c` is a plain C shared library that `runner_fsm/pcp/native.py`
  loads with ctypes: no Python headers, no module init.
- `runner_fsm/audit/_step_lane.c` (`runner_fsm/audit/step_lane.py`) and
  `runner_fsm/integrations/vllm/recording/_step_core.c` (`.../recording/steps.py`) are CPython
  extensions: they need Python's headers.

setuptools builds both as optional Extensions, so that `pip install .`, an sdist and a wheel
built where a C compiler is carry them inside the package, and a machine without one still
installs: plans are written by numpy, the step lane and the recorder's step path by Python, and each loader's `status()`
says why, from the build's error kept beside the package (`<name>.build-error`). A wheel holds
its compiled parts for one platform (and the extension for one Python).
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

LAYOUT = "runner_fsm/pcp/_mrv2_layout.c"
LANE = "runner_fsm/audit/_step_lane.c"
CORE = "runner_fsm/integrations/vllm/recording/_step_core.c"
# Without it, what runs instead (said in the build's warning)
INSTEAD = {LAYOUT: "runner_fsm plans PCP layouts in numpy instead",
           LANE: "runner_fsm writes the step lane in Python instead",
           CORE: "runner_fsm runs the vLLM recorder's step path in Python instead"}


def digest(source: str) -> str:
    """The stamp each loader compares with the shipped source's: the start of its sha256."""
    return hashlib.sha256((Path(__file__).resolve().parent / source).read_bytes()).hexdigest()[:16]


class OptionalLibrary(build_ext):
    """build_ext for optional parts: the ctypes library named as native.py looks for it."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the full dotted name, and (by get_ext_fullpath) with its last part alone
        if fullname.rsplit(".", 1)[-1] != "_mrv2_layout":
            return super().get_ext_filename(fullname)  # a CPython extension: its Python's tag
        # `_mrv2_layout.so`, no Python tag: it links nothing of Python's
        return os.path.join(*fullname.split(".")) + (".dll" if os.name == "nt" else ".so")

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name != "runner_fsm.pcp._mrv2_layout":
            return super().get_export_symbols(ext)  # PyInit_<name>
        return ext.export_symbols  # its own functions, not a PyInit_ it does not have

    def build_extension(self, ext: Extension) -> None:
        (source,) = ext.sources
        note = Path(self.get_ext_fullpath(ext.name)).parent / (ext.name.rsplit(".", 1)[1] + ".build-error")
        if self.compiler.compiler_type == "unix":
            ext.extra_compile_args = ["-O3"]
        try:
            super().build_extension(ext)
        except (CCompilerError, BaseError, OSError) as error:  # no compiler, no headers, or it failed
            message = f"building {source} failed: {type(error).__name__}: {error}"
            self.warn(f"{message}; {INSTEAD[source]}")
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(message + "\n")
            return
        note.unlink(missing_ok=True)


setup(
    ext_modules=[
        Extension(
            "runner_fsm.pcp._mrv2_layout", [LAYOUT], optional=True,
            define_macros=[("MRV2_SOURCE_DIGEST", f'"{digest(LAYOUT)}"')],
            export_symbols=["mrv2_layout_source_digest", "mrv2_dispatch_count", "mrv2_plan", "mrv2_rank_segments",
                            "mrv2_is_running_sum"],
        ),
        Extension(
            "runner_fsm.audit._step_lane", [LANE], optional=True,
            define_macros=[("STEP_LANE_SOURCE_DIGEST", f'"{digest(LANE)}"')],
        ),
        Extension(
            "runner_fsm.integrations.vllm.recording._step_core", [CORE], optional=True,
            define_macros=[("STEP_CORE_SOURCE_DIGEST", f'"{digest(CORE)}"')],
        ),
    ],
    cmdclass={"build_ext": OptionalLibrary},
)
