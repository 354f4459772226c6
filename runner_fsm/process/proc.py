"""What /proc says of another process: when it started, its parent, whether it still runs.

A pid alone may name another process once the first is gone (pids are reused); a pid with its
start time (clock ticks since boot, /proc/<pid>/stat field 22) names one process.
"""

from __future__ import annotations


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 on); None: no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and ')'
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> str | None:
    """When process `pid` started, as text; None: no such process here."""
    fields = stat_fields(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def parent_of(pid: int) -> int:
    """Process `pid`'s parent (0: none, or no such process)."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 else 0


def alive(pid: int, start: str | None) -> bool:
    """Whether the process that had `pid` and started at `start` still runs (a zombie has ended)."""
    fields = stat_fields(pid)
    return (fields is not None and len(fields) > 19 and fields[19].decode() == str(start)
            and fields[0] not in (b"Z", b"X"))
