"""A stop request written where it started: the line a front process adds to the run directory.

The process that receives the user's Ctrl-C or SIGTERM (vLLM's front, `integrations.vllm.
stop_origin`; the embedded launcher, `engine.launch`) writes `stops-<host>-<pid>.jsonl` into
the run directory before it stops anything, one line per request: which signal (None where the
process heard a stop without its name), what received it, and which ranks' processes were alive
at that moment. Replay reads these lines beside the rank logs (`replay.rundirs.read_origins`):
a rank alive when its stop was asked for ended in the stop, whatever it recorded itself.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

EVENT = "stop_request"


def record_request(run_dir: str | os.PathLike[str], run_id: str, signal_name: str | None, process: str,
                   alive: Iterable[int], gone: Iterable[int] = ()) -> None:
    """Append one request to `run_dir`'s file of this process (may raise OSError)."""
    host = socket.gethostname()
    line = {"event": EVENT, "run_id": str(run_id), "signal": signal_name, "process": process, "host": host,
            "pid": os.getpid(), "t_ns": time.monotonic_ns(), "alive": sorted(alive), "gone": sorted(gone)}
    with open(Path(run_dir) / f"stops-{host}-{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")
