"""What the loaders of the package's compiled parts share: the stamp a part is built with, and
why a part is not there, and the loading of an extension (`pcp/native.py`: the PCP layout;
`audit/step_lane.py`: the step lane; `integrations/vllm/recording/steps.py`: the recorder's step path).

setup.py and the Makefile build each part stamped with the start of its source's sha256, and
setup.py leaves the build's error beside the package where a part could not be built."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import ModuleType


def source_digest(source: Path) -> str:
    """The stamp of a part built from `source`."""
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def not_built(name: str, build_error: Path, needs: str, detail: str = "") -> str:
    """Why part `name` is not there: the build's error where setup.py left one, else that it
    was never built. `needs`: what building it takes ("a C compiler")."""
    try:
        failed = build_error.read_text().strip()
    except OSError:
        return (f"{name} is not built ({detail + '; ' if detail else ''}in a checkout `make` builds it;"
                f" pip install builds it where {needs} is)")
    return f"{name} was not built when this package was installed: {failed}. Installing it where {needs} is builds it"


def load_extension(name: str, source: Path, build_error: Path) -> tuple[ModuleType | None, str | None]:
    """CPython extension `name` built from `source`, or None and why not: not built, or built
    from other source than the one beside it (its `SOURCE_DIGEST`)."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        return None, not_built(name, build_error, "a C compiler with Python's headers", str(error))
    try:
        shipped = source_digest(source)
    except OSError as error:
        return None, f"its source {source.name} cannot be read: {error}"
    if module.SOURCE_DIGEST != shipped:
        return None, (f"{name} was built from other source (sha256 {module.SOURCE_DIGEST}...) than the"
                      f" {source.name} beside it ({shipped}...): rebuild it")
    return module, None
