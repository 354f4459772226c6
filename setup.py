"""The build of runner-fsm's one compiled part (the metadata is in pyproject.toml).

`runner_fsm/pcp/_mrv2_layout.c` is a plain C shared library that `runner_fsm/pcp/native.py`
loads with ctypes: no Python headers, no module init. setuptools builds it as an optional
Extension, so that `pip install .`, an sdist and a wheel built where a C compiler is carry it
inside the package, and a machine without one still installs: plans are then written by numpy,
and `native.status()` says why, from the build's error kept beside the package
(`_mrv2_layout.build-error`). A wheel holds it for one platform.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

LAYOUT = "runner_fsm/pcp/_mrv2_layout.c"
INSTEAD = "runner_fsm plans PCP layouts in numpy instead"  # said in the build's warning


def digest(source: str) -> str:
    """The stamp each loader compares with the shipped source's: the start of its sha256."""
    return hashlib.sha256((Path(__file__).resolve().parent / source).read_bytes()).hexdigest()[:16]


class OptionalLibrary(build_ext):
    """build_ext for optional parts: the ctypes library named as native.py looks for it."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the full dotted name, and (by get_ext_fullpath) with its last part alone
        # `_mrv2_layout.so`, no Python tag: it links nothing of Python's
        return os.path.join(*fullname.split(".")) + (".dll" if os.name == "nt" else ".so")

    def get_export_symbols(self, ext: Extension) -> list[str]:
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
            self.warn(f"{message}; {INSTEAD}")
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
    ],
    cmdclass={"build_ext": OptionalLibrary},
)
