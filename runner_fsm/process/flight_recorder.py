"""PyTorch's Flight Recorder, on by default: each rank dumps its ring buffer beside its log.

The Flight Recorder keeps, per process, the last N collectives torch issued (process group,
sequence number, op, sizes, whether it completed). Torch reads `TORCH_FR_BUFFER_SIZE` once, when
the process makes its first process group; in torch 2.13 it records gloo collectives too, and
an unset variable means torch's default of 2000 entries (seen: it records), so only an explicit
0 turns recording off.
On a fault, a collective timeout or the end of a run each rank writes `fr-rank-<global_rank>.json`
beside its audit log, and `runner-fsm replay` joins the two by group and sequence number
(`runner_fsm.replay.flight`).

Turning it off: `RUNNER_FSM_FLIGHT_RECORDER=0` in the environment of the run (`enable()` then
sets `TORCH_FR_BUFFER_SIZE=0` and nothing is dumped), or `TORCH_FR_BUFFER_SIZE=0`. Its cost per
step is measured in `make bench`.

Two calls, for any worker (the embedded engine makes them, and the vLLM worker through
`integrations/vllm/recording/flight.py`):
- `enable()` once per process, *before* `init_process_group` (vLLM: before
  `init_distributed_environment`); it only sets the environment torch reads;
- `dump_beside(run_dir, global_rank, groups, reason)` when the worker stops, faults or times
  out, with `groups` naming the process groups the audit log names (`{"dp": dp_cpu_group, ...}`).

There is no public dump API in torch 2.13: `torch._C._distributed_c10d._dump_fr_trace_json` is
the one PyTorch's own tools call. It is looked up at start-up (`require_api`) and a missing
one fails with a message saying so, never silently.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runner_fsm.errors import RunnerError

DISABLE_ENV = "RUNNER_FSM_FLIGHT_RECORDER"  # "0", "off", "false", "no": leave it off
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"  # what torch reads when the first group is created
DEFAULT_BUFFER_SIZE = 2000  # entries per process; a step issues about ten
DUMP_FORMAT = "runner_fsm.process.flight_recorder/1"
_OFF = frozenset({"0", "off", "false", "no"})


class FlightRecorderUnavailable(RunnerError):
    """The installed torch has no Flight Recorder dump call."""


def dump_file(run_dir: str | os.PathLike[str], global_rank: int) -> Path:
    """Where the Flight Recorder dump of this global rank lives: beside its audit log."""
    return Path(run_dir) / f"fr-rank-{int(global_rank)}.json"


def wanted() -> bool:
    """False when the user turned the recorder off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in _OFF


def active() -> bool:
    """Is the recorder recording in this process (as far as the environment says)?"""
    try:
        return wanted() and int(os.environ.get(BUFFER_ENV, "0")) > 0
    except ValueError:
        return False


def require_api():
    """The private dump call of torch's Flight Recorder; `FlightRecorderUnavailable` if absent."""
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        raise FlightRecorderUnavailable(
            f"torch {torch.__version__} has no torch._C._distributed_c10d._dump_fr_trace_json (the Flight"
            f" Recorder dump, checked against torch 2.13); set {DISABLE_ENV}=0 to run without it")
    return dump


def enable(buffer_size: int = DEFAULT_BUFFER_SIZE, *, check_api: bool = True) -> bool:
    """Turn the recorder on for process groups created from now on (in this process and the
    processes it starts). Returns False when the user turned it off: then it is set to 0, since
    torch records by default. A size the user set wins. `check_api=False`: the processes that
    make the groups check the dump call (`require_api`) themselves, before their first group."""
    if not wanted():
        os.environ[BUFFER_ENV] = "0"
        return False
    if check_api:
        require_api()
    os.environ.setdefault(BUFFER_ENV, str(int(buffer_size)))
    return active()


def disable() -> None:
    """Leave the recorder off for process groups created from now on (benchmarks, tests)."""
    os.environ[DISABLE_ENV] = "0"
    os.environ[BUFFER_ENV] = "0"  # unset would be torch's default: on


@contextlib.contextmanager
def enabled_for_children(buffer_size: int = DEFAULT_BUFFER_SIZE) -> Iterator[bool]:
    """`enable()` for the processes started inside the block; this process's environment is
    restored after it (children copy the environment when they start). The dump call is checked
    by the children, where torch is (`require_api` when `active()`): a launcher that imports no
    torch (`runner-fsm run`) does not load it for this."""
    saved = os.environ.get(BUFFER_ENV)
    try:
        yield enable(buffer_size, check_api=False)
    finally:
        if saved is None:
            os.environ.pop(BUFFER_ENV, None)
        else:
            os.environ[BUFFER_ENV] = saved


def snapshot() -> dict[str, Any]:
    """This process's Flight Recorder buffer, as torch renders it (collectives, no stacks)."""
    return json.loads(require_api()(True, False))


def describe_groups(groups: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{audit name: {"pg_name", "ranks"}} for each process group this rank is a member of;
    the dump identifies groups by `pg_name`, the audit log by these names."""
    import torch.distributed as dist

    described = {}
    for name, group in groups.items():
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        described[name] = {"pg_name": str(group.group_name),
                           "ranks": [int(r) for r in dist.get_process_group_ranks(group)]}
    return described


def dump_beside(run_dir: str | os.PathLike[str], global_rank: int, groups: Mapping[str, Any] | None,
                reason: str) -> Path | None:
    """Write this rank's buffer to `fr-rank-<global_rank>.json` in `run_dir`; None when the
    recorder is off. `reason`: why now (`end`, `fault`, `timeout`). Written whole, then renamed,
    so a reader never sees half a dump."""
    if not active():
        return None
    document = {"format": DUMP_FORMAT, "global_rank": int(global_rank), "reason": str(reason),
                "groups": describe_groups(groups or {}), "trace": snapshot()}
    path = dump_file(run_dir, global_rank)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(document, separators=(",", ":")))
    partial.replace(path)
    return path


def groups_of(process_groups) -> dict[str, Any]:
    """The audit names of an engine rank's groups (`engine.groups.ProcessGroups`)."""
    if process_groups is None:
        return {}
    return {"dp": process_groups.dp, "pcp": process_groups.pcp, "expert": process_groups.expert,
            "world": process_groups.world}


def reason_of(error: dict | None) -> str:
    """`end`, `timeout` or `fault`, from a rank's reported error."""
    if error is None:
        return "end"
    return "timeout" if error.get("type") in ("CollectiveTimeout", "TimeoutError") else "fault"
