"""The build of runner-fsm's one compiled part (the metadata is in pyproject.toml).

`runner_fsm/pcp/_mrv2_layout.c` is a plain C shared library that `runner_fsm/pcp/native.py`
loads with ctypes: no Python headers, no module init. setuptools builds it as an optional
Extension, so that `pip install .`, an sdist and a wheel built where a C compiler is carry it
inside the package, and a machine without one still installs: its plans are written by numpy,
and `runner_fsm.pcp.native.status()` says why, from the build's error kept beside the package
(`_mrv2_layout.build-error`). A wheel holds a library for one platform.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

SOURCE = "runner_fsm/pcp/_mrv2_layout.c"
# The stamp the loader compares with the shipped source's: the start of its sha256.
DIGEST = hashlib.sha256((Path(__file__).resolve().parent / SOURCE).read_bytes()).hexdigest()[:16]


class OptionalLibrary(build_ext):
    """build_ext for a ctypes library: named as native.py looks for it, and optional."""

    def get_ext_filename(self, fullname: str) -> str:
        # `_mrv2_layout.so`, no Python tag: it links nothing of Python's
        return os.path.join(*fullname.split(".")) + (".dll" if os.name == "nt" else ".so")

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return ext.export_symbols  # its own functions, not a PyInit_ it does not have

    def build_extension(self, ext: Extension) -> None:
        note = Path(self.get_ext_fullpath(ext.name)).with_suffix(".build-error")
        if self.compiler.compiler_type == "unix":
            ext.extra_compile_args = ["-O3"]
        try:
            super().build_extension(ext)
        except (CCompilerError, BaseError, OSError) as error:  # no compiler, or it failed
            message = f"building {SOURCE} failed: {type(error).__name__}: {error}"
            self.warn(f"{message}; runner_fsm plans PCP layouts in numpy instead")
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(message + "\n")
            return
        note.unlink(missing_ok=True)


setup(
    ext_modules=[Extension(
        "runner_fsm.pcp._mrv2_layout", [SOURCE], optional=True,
        define_macros=[("MRV2_SOURCE_DIGEST", f'"{DIGEST}"')],
        export_symbols=["mrv2_layout_source_digest", "mrv2_dispatch_count", "mrv2_plan", "mrv2_rank_segments",
                        "mrv2_is_running_sum"],
    )],
    cmdclass={"build_ext": OptionalLibrary},
)
