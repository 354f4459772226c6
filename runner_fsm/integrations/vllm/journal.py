"""What vLLM decided per step, one compact JSON line per step: `<run_dir>/vllm-steps-<rank>.jsonl`.

The audit log (`rank-<global_rank>.jsonl`, DESIGN section 7) keeps the schema that replay
judges; its record types have no field for vLLM's own decisions, so those go here, keyed by
the same step ids: the scheduled requests and token counts, new/resumed/finished requests,
scheduled draft tokens, per forward (real or dummy) the graph mode, batch descriptor and DP
token counts, the sampled tokens, and the drafter's proposals. Lines are buffered (this file
is for diagnosis; the audit log, flushed per line, is the evidence a crash leaves behind) and
flushed on a fault and at shutdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def journal_path(run_dir: str, global_rank: int) -> Path:
    return Path(run_dir) / f"vllm-steps-{int(global_rank)}.jsonl"


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "name"):  # enums (graph modes)
        return obj.name
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"journal cannot serialise {type(obj).__qualname__}")


class Journal:
    def __init__(self, run_dir: str, global_rank: int):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = journal_path(run_dir, global_rank)
        self._file = open(self.path, "xb")

    def write(self, entry: dict) -> None:
        self._file.write(orjson.dumps(entry, default=_default, option=OPTIONS) + b"\n")

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_journal(run_dir: str, global_rank: int = 0) -> list[dict]:
    return [orjson.loads(line) for line in journal_path(run_dir, global_rank).read_bytes().splitlines()]
