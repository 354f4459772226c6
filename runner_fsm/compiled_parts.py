"""What the loaders of the package's compiled parts share: the stamp a part is built with, and
why a part is not there (`pcp/native.py`: the PCP layout; `audit/step_lane.py`: the step lane).

setup.py and the Makefile build each part stamped with the start of its source's sha256, and
setup.py leaves the build's error beside the package where a part could not be built."""

from __future__ import annotations

import hashlib
from pathlib import Path


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
