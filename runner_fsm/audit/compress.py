"""Closed segments compressed, an option of a capped log: `rank-<g>.<k>.jsonl.gz`.

A closed segment is rewritten as gzip members, one per entry of its step index (`stepindex`),
each member beginning where a step begins, and the index learns where each member starts: a
reader seeks to a step's member and decompresses from there, never from the segment's start.
`gzip`, `zcat` and `jq` read the file as one stream. The writer compresses in a thread of its
own process, off the step's path, and removes the plain segment once the compressed one is
whole; while both exist, readers take the plain one. Segment 0, which becomes the log's head,
is never compressed.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Callable

from runner_fsm.audit import stepindex

SUFFIX = ".gz"
LEVEL = 6


def compressed(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def is_compressed(path: Path) -> bool:
    return path.name.endswith(SUFFIX)


def compress(path: Path, lock: threading.Lock | None = None) -> Path | None:
    """`path` as `path.gz` (see the module docstring); None when it was deleted meanwhile.
    `lock`: held by whoever deletes segments (`segments`), taken here to put the compressed
    form in place: a segment rotated away while it was being compressed must stay away."""
    target = compressed(path)
    temporary = target.with_name(target.name + ".tmp")
    try:
        index = stepindex.read(path) or stepindex.write(path)
        starts = [0] + [offset for _, offset, _ in index.entries if offset > 0]
        members = []
        with open(path, "rb") as source, open(temporary, "wb") as out:
            for start, end in zip(starts, starts[1:] + [index.size]):
                source.seek(start)
                members.append((start, out.tell()))
                out.write(gzip.compress(source.read(end - start), compresslevel=LEVEL, mtime=0))
            size = out.tell()
        with lock or contextlib.nullcontext():
            if not path.exists():
                raise FileNotFoundError(path)
            stepindex.write(path, index, members=members, compressed_size=size)
            os.replace(temporary, target)
            os.unlink(path)
        return target
    except OSError as error:  # never a partial `.gz.tmp` left beside the plain segment
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, FileNotFoundError):  # rotated away before it was compressed, or while it was
            return None
        raise


def report_failure(log, path: Path, error: OSError) -> None:
    """A closed segment of `log` (an `AuditLog`) could not be compressed and stays plain (a full
    disk, say): a line on stderr and a `storage` record, which replay lists in its notes. From the
    compressor's thread, written as a signal handler's record is: it waits for the log's lock a
    moment at most (the holder may be waiting for this thread), else the next write takes it."""
    what = f"{type(error).__name__}: {error}"
    print(f"runner_fsm: {log.path.name}: compressing {path.name} failed ({what}); it stays plain",
          file=sys.stderr, flush=True)
    log.write_in_handler("storage", None, {"action": "compress", "file": path.name, "error": what})


@contextlib.contextmanager
def open_lines(path: Path, offset: int = 0) -> Iterator[BinaryIO]:
    """The segment's bytes as lines, from the byte `offset` of its plain text (in a compressed
    segment, an offset its step index holds: where a member begins)."""
    if not is_compressed(path):
        with open(path, "rb") as handle:
            if offset:
                handle.seek(offset)
            yield handle
        return
    member = 0
    if offset:
        index = stepindex.read(path)
        found = dict(index.members) if index is not None else {}
        if offset not in found:
            raise ValueError(f"{path}: no gzip member begins at byte {offset} of its text")
        member = found[offset]
    with open(path, "rb") as raw:
        raw.seek(member)
        with gzip.GzipFile(fileobj=raw, mode="rb") as lines:
            yield lines


class Compressor:
    """One thread that compresses the segments it is given, in order; a daemon: a process
    that ends leaves a segment plain (and perhaps a `.gz.tmp` beside it), never broken."""

    def __init__(self, on_error: Callable[[Path, OSError], None] | None = None) -> None:
        """`on_error(path, error)`: a segment could not be compressed (it stays plain), said by
        the log that owns it; called from this thread."""
        self._on_error = on_error
        self.lock = threading.Lock()  # held while a segment is deleted (`segments`) or put in place
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="runner-fsm-compress", daemon=True)
        self._thread.start()

    def submit(self, path: Path) -> None:
        self._queue.put(path)

    def drain(self) -> None:
        """Wait until every segment given so far is compressed (tests, a clean shutdown)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            try:
                compress(path, self.lock)
            except OSError as error:  # a full disk: the segment stays plain, and the log says so
                if self._on_error is not None:
                    self._on_error(path, error)
            finally:
                self._queue.task_done()
