"""The worker's own options.

They come from `additional_config={"runner_fsm": {...}}` (`--additional-config` on the server),
else from `RUNNER_FSM_*` environment variables, else the defaults:

| key                   | env                              | default                              |
|-----------------------|----------------------------------|--------------------------------------|
| run_dir               | RUNNER_FSM_RUN_DIR               | runs/vllm-<time>-<pid> (rank 0's, one for the whole job) |
| run_id                | RUNNER_FSM_RUN_ID                | rank 0's `vllm-<time>-<pid>`, agreed by every rank (a given one must be the same on every rank) |
| collective_timeout_s  | RUNNER_FSM_COLLECTIVE_TIMEOUT_S  | 120                                  |
| inject                | RUNNER_FSM_INJECT                | none (fault injection, `KIND@replica=R,step=S`) |
| audit                 | RUNNER_FSM_AUDIT                 | full (`transitions`: no buffers records) |
| fast_pcp_layout       | RUNNER_FSM_FAST_PCP_LAYOUT       | false (true: MRV2's PCP layout vectorised, `runners/pcp/layout.py`) |
| max_log_bytes         | RUNNER_FSM_MAX_LOG_BYTES         | 2G per rank (audit log, step journal, Flight Recorder dump; 0: no cap; `audit.segments`) |
| pinned_steps          | RUNNER_FSM_PINNED_STEPS          | 1000 (steps kept before a fault, an injected fault, and the current step) |
| compress_logs         | RUNNER_FSM_COMPRESS_LOGS         | false (true: closed segments gzip-compressed, `audit.compress`) |
| consensus             | RUNNER_FSM_CONSENSUS             | false (true: a replica's ranks compare their decisions each step, `replica_check`) |

Everything else (graphs, capture sizes, speculation, limits) is vLLM's own configuration.
Duck-typed on vLLM's config objects (no vLLM import).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from runner_fsm.audit.segments import DEFAULT_MAX_LOG_BYTES, DEFAULT_PINNED_STEPS, parse_bytes
from runner_fsm.errors import ConfigError

CONFIG_KEY = "runner_fsm"
ENV_PREFIX = "RUNNER_FSM_"
AUDIT_LEVELS = ("full", "transitions")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How the worker records its replica; identical on every rank of a vLLM job."""

    run_dir: str | None = None  # None: rank 0 picks runs/vllm-<time>-<pid> and shares it (`rundir.agree_run`)
    run_id: str | None = None
    collective_timeout_s: float = 120.0
    inject: str | None = None
    audit: str = "full"
    fast_pcp_layout: bool = False
    max_log_bytes: int | None = DEFAULT_MAX_LOG_BYTES  # None: one file, no cap
    pinned_steps: int = DEFAULT_PINNED_STEPS
    compress_logs: bool = False
    consensus: bool = False

    @classmethod
    def from_vllm(cls, vllm_config: Any, environ: Mapping[str, str] = os.environ) -> "WorkerOptions":
        given = _additional(vllm_config)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ConfigError(f"additional_config[{CONFIG_KEY!r}] has unknown keys {unknown}; known: {known}")

        def pick(name: str):
            if name in given:
                return given[name]
            return environ.get(ENV_PREFIX + name.upper()) or None

        timeout = pick("collective_timeout_s")
        audit = str(pick("audit") or "full")
        if audit not in AUDIT_LEVELS:
            raise ConfigError(f"audit must be one of {list(AUDIT_LEVELS)}, got {audit!r}")
        try:
            timeout_s = float(timeout) if timeout is not None else cls.collective_timeout_s
        except (TypeError, ValueError):
            raise ConfigError(f"collective_timeout_s must be a number of seconds, got {timeout!r}") from None
        if timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s must be positive, got {timeout_s}")
        inject = pick("inject")
        return cls(run_dir=_opt_str(pick("run_dir")), run_id=_opt_str(pick("run_id")),
                   collective_timeout_s=timeout_s, inject=_opt_str(inject), audit=audit,
                   fast_pcp_layout=_flag("fast_pcp_layout", pick("fast_pcp_layout")),
                   max_log_bytes=_log_cap(pick("max_log_bytes")), pinned_steps=_count("pinned_steps", pick("pinned_steps")),
                   compress_logs=_flag("compress_logs", pick("compress_logs")),
                   consensus=_flag("consensus", pick("consensus")))


def _flag(name: str, value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _log_cap(value: Any) -> int | None:
    if value is None:
        return DEFAULT_MAX_LOG_BYTES
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise ConfigError(f"max_log_bytes: {err}") from None


def _count(name: str, value: Any) -> int:
    if value is None:
        return DEFAULT_PINNED_STEPS
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if count < 0:
        raise ConfigError(f"{name} must be a number of steps >= 0, got {value!r}")
    return count


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _additional(vllm_config: Any) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get(CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config[{CONFIG_KEY!r}] must be a mapping, got {section!r}")
    return dict(section)
