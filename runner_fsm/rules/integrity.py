"""The checks of a log file itself, before any rule: a line that does not parse (a `gap`: the
record is lost; a last line without its newline is one the process died writing), a record
without its header (`gap`: it cannot be checked), and `seq` running gapless from 0 (`gap`).

A collective's `pg_seq` must count on by one per group: a jump means a collective ran without
its record, or the record is lost (`gap`).

`LogIntegrity` is the part of `scan.RankScanner` that does them; the scanner gives it
`_verdict` and keeps `_next_seq` (None right after a seek: nothing to compare the first
record read with) and `_truncated`.
"""

from __future__ import annotations


class LogIntegrity:
    _next_seq: int | None
    _truncated: bool

    def _verdict(self, kind: str, detail: str, **where) -> None:
        raise NotImplementedError

    def _unparsable(self, raw: bytes, err: Exception) -> None:
        if self._next_seq is not None:
            self._next_seq += 1  # the damaged line most likely held one record
        if not raw.endswith(b"\n"):
            self._truncated = True
            self._verdict("gap", f"truncated last line ({len(raw)} bytes, no newline): the process"
                          " died while writing it; the record is lost")
        else:
            self._verdict("gap", f"unparsable line: {err}")

    def _malformed(self, what: str) -> None:
        self._verdict("gap", f"{what}; the record cannot be checked")

    def _seq_gap(self, seq) -> None:
        expected = self._next_seq
        valid = isinstance(seq, int) and not isinstance(seq, bool)
        self._next_seq = seq + 1 if valid else (expected + 1 if expected is not None else None)
        if expected is None:  # the first record read after resume_mid_file
            return
        if isinstance(seq, int) and seq > expected:
            missing = f"seq {expected}" if seq == expected + 1 else f"seq {expected}..{seq - 1}"
            self._verdict("gap", f"{missing} missing: seq jumps from {expected - 1} to {seq}")
        elif isinstance(seq, int):
            self._verdict("gap", f"seq {seq} repeated or out of order (expected {expected})")
        else:
            self._verdict("gap", f"seq is {seq!r}, expected {expected}")

    def _pg_seq_break(self, group: str, last, pg_seq):
        """The first collective of a group, or a break in its count: pg_seq as an int (or None)."""
        if pg_seq is None:
            return None
        if not isinstance(pg_seq, int) or isinstance(pg_seq, bool):
            self._malformed(f"pg_seq of group '{group}' is {pg_seq!r}, not an integer")
            return None
        if last is not None:
            self._verdict("gap", f"pg_seq of group '{group}' jumps from {last} to {pg_seq}: a collective"
                          " on this group ran without an audit record, or its record is lost")
        return pg_seq
