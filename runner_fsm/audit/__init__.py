"""Audit trail of a run: the per-process JSONL log (and, next to it, its replay checker)."""

from runner_fsm.audit.log import (
    SCHEMA_VERSION,
    AuditLog,
    AuditLogClosedError,
    AuditLogFormatError,
    log_path,
    read_records,
    strip_times,
)

__all__ = [
    "SCHEMA_VERSION",
    "AuditLog",
    "AuditLogClosedError",
    "AuditLogFormatError",
    "log_path",
    "read_records",
    "strip_times",
]
