"""Audit trail of a run: the per-process JSONL log (and, next to it, its replay checker).

The writer's names are loaded on first use (PEP 562), not with the package: `runner-fsm
replay` imports the checker's modules only, and the writer's logging stack (structlog, rich)
would be a fifth of its start-up.
"""

from __future__ import annotations

import importlib

__all__ = [
    "SCHEMA_VERSION",
    "AuditLog",
    "AuditLogClosedError",
    "AuditLogFormatError",
    "log_path",
    "read_records",
    "strip_times",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("runner_fsm.audit.log"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
