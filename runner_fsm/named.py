"""A function or class named as "module:attribute", imported where it is used: a rank's entry
that its launcher must not import (`engine.launch.spawn`), a model factory or a `Job.run` that
production code names but never imports itself, a graph class given in the environment."""

from __future__ import annotations

import importlib
from typing import Any


def named(spec: str) -> Any:
    """The attribute `spec` ("module:attribute") names, its module imported now."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
