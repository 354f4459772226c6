"""What the scan notes about how each rank's log ends, for the rules judged over the whole job
once every log is read: the stop requests (`stops`) and the injected faults (`injections`).

All of it is rare (a few records per rank), so it is kept whole; ranges of steps judged in
several processes (`ranges`) each fill their own `RunFacts` and `merge` them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StopSeen:
    """A `stop` record: the rank received a stop request (a signal, the engine's shutdown call)."""

    rank: int
    step: int | None
    seq: int
    t_ns: int
    source: str
    signal: str | None
    detail: str = ""

    def text(self) -> str:
        if self.source == "signal":
            what = self.signal or "a stop signal"
        else:
            what = "the engine's shutdown call"
        return f"{what} ({f'{self.detail}; ' if self.detail else ''}rank {self.rank}, step {self.step})"


@dataclasses.dataclass(frozen=True)
class OriginStop:
    """A stop request recorded where it started: by vLLM's front process (`stop_origin`) or the
    embedded launcher, in the run directory, before any rank was stopped; with the ranks whose
    process was there then."""

    host: str | None
    pid: int
    process: str  # what received it: "vLLM's API server", ...
    signal: str | None  # None: the process heard a stop signal without its name
    t_ns: int  # the host's monotonic clock
    alive: frozenset[int]
    gone: frozenset[int] = frozenset()

    @staticmethod
    def from_record(record: dict) -> tuple["OriginStop", str]:
        """One line of `stops-<host>-<pid>.jsonl` and the run it belongs to (KeyError, TypeError,
        ValueError: not such a line)."""
        if record["event"] != "stop_request":
            raise ValueError(f"event {record['event']!r}")
        if not all(map(_is_int, [record["pid"], record["t_ns"], *record["alive"], *record.get("gone", ())])):
            raise ValueError("pid, t_ns and ranks must be integers")
        signal, host = record.get("signal"), record.get("host")
        return OriginStop(host if isinstance(host, str) else None, record["pid"], str(record["process"]),
                          signal if isinstance(signal, str) else None, record["t_ns"],
                          frozenset(record["alive"]), frozenset(record.get("gone", ()))), str(record["run_id"])

    def text(self) -> str:
        where = f"pid {self.pid}" + (f" on host {self.host}" if self.host else "")
        return f"{self.signal or 'a stop signal'} received by {self.process} ({where})"


@dataclasses.dataclass(frozen=True)
class FaultSeen:
    """A `fault` record, with where it lies in its rank's log and when it was written."""

    rank: int
    step: int | None
    seq: int
    t_ns: int
    detail: str  # as the `fault` verdict says it: "Error: message"


@dataclasses.dataclass(frozen=True)
class RankEnd:
    """Where a rank's log ends: its last step, the time of its last record, its state then."""

    rank: int
    replica: int
    step: int
    t_read: int | None  # as read; after a seek, on from `origin`'s time base (`seek.SeekOrigin`)
    state: str | None
    in_collective: bool
    origin: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def t_ns(self) -> int | None:
        """The time of its last record: after a seek, the segment is read up to it for its
        time base, so only a rule that compares it (`stops`) pays for that."""
        if self.t_read is None or self.origin is None:
            return self.t_read
        return self.t_read + self.origin.time_shift()


@dataclasses.dataclass
class RunFacts:
    stops: list[StopSeen] = dataclasses.field(default_factory=list)
    faults: list[FaultSeen] = dataclasses.field(default_factory=list)
    ends: dict[int, RankEnd] = dataclasses.field(default_factory=dict)
    hosts: dict[int, str | None] = dataclasses.field(default_factory=dict)  # the job record's `host`
    injections: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # its `inject`
    fired: set[tuple[int, int | None, str]] = dataclasses.field(default_factory=set)  # (rank, step, injection)
    # (replica, step) -> the kind of step (prefill, decode, idle) its ranks ran, for each step an
    # injection names: what an injection that never fired found there
    kinds: dict[tuple[int, int], str | None] = dataclasses.field(default_factory=dict)
    # what a rank's log said of its own files (`storage` records: a segment left uncompressed), in words
    storage: list[str] = dataclasses.field(default_factory=list)
    # stop requests recorded at their origin (not by a rank: read beside the logs, `replay.rundirs.read_origins`)
    origins: list[OriginStop] = dataclasses.field(default_factory=list)
    fronted: set[int] = dataclasses.field(default_factory=set)  # ranks whose front records requests (`job`)

    def note(self, rank: int, record: dict, origin=None) -> None:
        """Keep what a `fault`, `stop`, `injected` or `job` record says (ValueError: malformed);
        `origin`: the `seek.SeekOrigin` of a record read after a seek (its time base)."""
        event, step, seq, t_ns = record["event"], record["step_id"], record["seq"], record.get("t_ns")
        if origin is not None and _is_int(t_ns) and event in ("stop", "fault"):
            t_ns += origin.time_shift()  # rare records: counted as they come
        if event == "job":
            inject = record.get("inject") or ()
            self.injections[rank] = tuple(map(str, [inject] if isinstance(inject, str) else inject))
            self.hosts[rank] = record.get("host")
            if record.get("stop_front") is True:
                self.fronted.add(rank)
        elif event == "injected":
            self.fired.add((rank, step, str(record["injection"])))
        elif event == "storage":
            self.storage.append(f"rank {rank}'s log could not {record.get('action')} {record.get('file')}"
                                f" ({record.get('error')}): it stays as it was, readable, over the log's cap")
        elif not (_is_int(seq) and _is_int(t_ns)):
            if event == "stop":
                raise ValueError(f"seq {seq!r} and t_ns {t_ns!r} must be integers")
        elif event == "stop":
            signal = record.get("signal")
            self.stops.append(StopSeen(rank, step, seq, t_ns, str(record["source"]),
                                       None if signal is None else str(signal), str(record.get("detail") or "")))
        elif event == "fault":
            self.faults.append(FaultSeen(rank, step, seq, t_ns, f"{record['error']}: {record['message']}"))

    def injected_steps(self) -> set[int]:
        from runner_fsm.faults import parse_target  # the embedded and vLLM kinds share the syntax

        return {parse_target(text)[1] for texts in self.injections.values() for text in texts
                if parse_target(text) is not None}

    def own_range(self, lo: int | None) -> "RunFacts":
        """The facts of steps from `lo` on: earlier ones, read to warm up, are another range's."""
        if lo is None:
            return self
        mine = lambda step: step is not None and step >= lo  # noqa: E731
        return dataclasses.replace(self, stops=[s for s in self.stops if mine(s.step)],
                                   faults=[f for f in self.faults if mine(f.step)],
                                   fired={f for f in self.fired if mine(f[1])},
                                   kinds={k: v for k, v in self.kinds.items() if k[1] >= lo})

    @staticmethod
    def merge(parts: list["RunFacts"]) -> "RunFacts":
        out = RunFacts()
        for part in parts:
            out.stops += part.stops
            out.faults += part.faults
            out.ends.update(part.ends)
            out.hosts.update(part.hosts)
            out.fronted |= part.fronted
            out.injections.update(part.injections)
            out.fired |= part.fired
            out.kinds.update(part.kinds)
            out.storage += [note for note in part.storage if note not in out.storage]  # ranges may both read one
        return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
