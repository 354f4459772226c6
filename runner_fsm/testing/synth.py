"""Synthetic audit logs: N ranks x S steps of the records the runner writes, with defects on demand.

The records follow `Replica`/`ReplicaRunner` step by step (DP agreement, buffers, graph replay,
step transition, draft agreements, finish), on a schedule that is a pure function of the
step and replica, so every rank writes its part of the same run without talking to the
others. Each `Defect` breaks one rule the replay checker enforces, on one replica at one
step, so that tests can assert the checker names exactly that replica and step.
Used by tests/test_replay*.py and benchmarks/bench_replay.py.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, DecisionLog, StepDecisions
from runner_fsm.audit.shape import Coords, coords_of, job_shape_fields
from runner_fsm.dp import wire_shape
from runner_fsm.pcp.buffers import BUFFER_NAMES
from runner_fsm.testing.synth_files import write_rank_log

DEFECTS = ("gap", "missing_replica", "agreed_mismatch", "pg_seq", "collective_mismatch",
           "skip_dummy_forward", "illegal_transition", "stale_buffer_replay", "moved_buffer", "hang",
           "deadlock", "truncated", "fault", "extra_draft_pass", "rank_graph_mode", "rank_tokens", "graph_demoted")
# Defects of one rank of the replica (`Defect.rank`), in the decisions it logs (`SynthSpec.decisions`).
RANK_DEFECTS = frozenset({"rank_graph_mode", "rank_tokens"})
CAPTURE_SIZES = (1, 2, 4, 8)
_SHAPES = {"query_start_loc": [33], "seq_lens": [32], "block_tables": [32, 64]}


@dataclasses.dataclass(frozen=True)
class SynthSpec:
    """The shape of a synthetic run; identical for every rank that writes it."""

    dp_size: int = 2
    pcp_size: int = 2
    tp_size: int = 1  # the TP ranks of a replica write its records alike, as vLLM's TP workers do
    steps: int = 8
    spec_tokens: int = 1  # K: DRAFT_PREFILL each step, DRAFT_DECODE too when K > 1
    graphs: bool = True  # FULL_DECODE_ONLY: capture at start, replay on decode-only steps
    log_agreed: bool = True  # `agreed` (the DPSyncState) on the `done` of DP collectives
    log_sent: bool = True  # `sent` (the replica's LocalDispatch) on their `enqueue`
    expert_collectives: bool = True  # forwards logged as 'expert' collectives, as the runner does
    model_collectives: bool = False  # a 'pcp' all_gather per forward when pcp_size > 1
    seed: int = 0
    run_id: str = "synth"
    job_shape: bool = True  # each log begins with the job's shape, as the runner's do
    job_names_k: bool = False  # ... and names K (`num_speculative_tokens`), as the vLLM worker's does
    hosts: tuple[str, ...] = ()  # each global rank's host (a job on several machines); () : all "synth"
    compact: bool = False  # records as the runner writes them now (`audit.compact`); False: in full
    max_log_bytes: int | None = None  # written through AuditLog under this cap (`audit.segments`)
    pinned_steps: int = 1000
    compress_segments: bool = False  # under the cap, closed segments gzip-compressed (`audit.compress`)
    decisions: bool = False  # each `finish` carries the step's decision digest (`audit.decisions`)


@dataclasses.dataclass(frozen=True)
class Defect:
    """One injected defect: `kind` (one of DEFECTS) on replica `replica` at step `step`.
    `extra_draft_pass` (K = 1): the replica enters a DRAFT_DECODE agreement no step has after
    its draft (vllm-ascend #12036) and waits there; its peers finish the step and wait outside
    the log (vLLM's engine loop), so every log ends in that step.
    With `SynthSpec.decisions`: `rank_graph_mode` (the replica's rank `rank` logs the other
    graph/eager mode), `rank_tokens` (it logs other sampled tokens), `graph_demoted` (the
    replica is idle and proposes eager while the others, decoding, propose a graph)."""

    kind: str
    replica: int
    step: int
    rank: int | None = None  # RANK_DEFECTS: the rank within the replica (None: its last)

    def __post_init__(self) -> None:
        if self.kind not in DEFECTS:
            raise ValueError(f"unknown defect {self.kind!r}; known: {', '.join(DEFECTS)}")


class _Schedule:
    """What every replica does at every step: a pure function of (seed, step, replica)."""

    def __init__(self, spec: SynthSpec, defects: Sequence[Defect]):
        self.spec = spec
        # A stale replay needs an idle replica on a graph step: force that schedule.
        self.forced = {(d.step, r): ("idle" if r == d.replica else "decode")
                       for d in defects if d.kind in ("stale_buffer_replay", "moved_buffer", "skip_dummy_forward",
                                                      "deadlock", "graph_demoted")
                       for r in range(spec.dp_size)}
        self.demoted = {(d.step, d.replica) for d in defects if d.kind == "graph_demoted"}

    def work(self, step: int, replica: int) -> str:
        forced = self.forced.get((step, replica))
        if forced is not None:
            return forced
        h = ((step + 1) * 2654435761 + replica * 40503 + self.spec.seed * 97) & 0xFFFF
        return "prefill" if h % 10 < 2 else "idle" if h % 10 < 4 else "decode"

    def tokens(self, step: int, replica: int, kind: str) -> int:
        if kind == "idle":
            return 0
        h = ((step + 3) * 40503 + replica * 2654435761) & 0xFF
        return 1 + h % 3 if kind == "decode" else 8 + h % 40

    def facts(self, step: int):
        """(work, tokens each replica sends, tokens the agreement gives, graph step?, all idle?)."""
        work = [self.work(step, r) for r in range(self.spec.dp_size)]
        sent = [self.tokens(step, r, k) for r, k in enumerate(work)]
        all_idle = not any(sent)
        graph = self.spec.graphs and not all_idle and "prefill" not in work and \
            not any(s == step for s, _ in self.demoted)
        agreed = list(sent)
        if graph:  # every replica pads to the smallest captured size that fits the largest
            agreed = [next(s for s in CAPTURE_SIZES if s >= max(sent))] * len(sent)
        return work, sent, agreed, graph, all_idle

    @staticmethod
    def agreed(step, phase, counts, graph, all_idle) -> dict:
        return {"step_id": step, "phase": phase, "num_tokens_across_dp": list(counts),
                "graph_mode": 2 if graph else 0, "uniform_token_count": 0,
                "num_reqs": 0 if all_idle else 1, "all_idle": all_idle}


class _RankWriter:
    """The records of one rank: its seq, pg_seq counters, buffer versions and state."""

    def __init__(self, spec: SynthSpec, schedule: _Schedule, global_rank: int, defects: Sequence[Defect]):
        self.spec, self.schedule = spec, schedule
        coords = coords_of(global_rank, Coords(spec.dp_size, 1, spec.pcp_size, spec.tp_size))
        self.dp_rank, self.pcp_rank, self.tp_rank = coords.dp, coords.pcp, coords.tp
        self.global_rank = global_rank
        per_replica = spec.pcp_size * spec.tp_size
        within = global_rank - self.dp_rank * per_replica
        self.defects = {(d.kind, d.step) for d in defects if d.replica == self.dp_rank and (
            d.kind not in RANK_DEFECTS or (per_replica - 1 if d.rank is None else d.rank) == within)}
        self.decision_log = DecisionLog()
        self.peer_defects = {(d.kind, d.step) for d in defects if d.replica != self.dp_rank}
        self.pg = {"dp": 0, "pcp": 0, "expert": 0}
        self.version = 0
        self.ptrs = {name: 0x5500_0000_0000 + global_rank * 0x100_0000 + i * 0x1000
                     for i, name in enumerate(BUFFER_NAMES)}
        self.records: list[tuple[str, int, dict]] = []  # (event, step, fields) of the current step

    def has(self, kind: str, step: int) -> bool:
        return (kind, step) in self.defects

    def has_any(self, kind: str, step: int) -> bool:
        return (kind, step) in self.defects or (kind, step) in self.peer_defects

    # -- record builders -----------------------------------------------------------------

    def _add(self, event: str, step: int, **fields) -> None:
        self.records.append((event, step, fields))

    def _transition(self, step, trigger, src, dst, outcome="ok") -> None:
        self._add("transition", step, trigger=trigger, src=src, dst=dst, outcome=outcome)

    def _collective(self, step, group, op, phase, shapes, *, sent=None, agreed=None, body=None,
                    done=True) -> None:
        """enqueue, what runs inside (`body`), done: the order `CollectiveRunner.run` logs."""
        pg = self.pg[group]
        self.pg[group] += 1
        fields = dict(group=group, op=op, phase=phase, shapes=shapes, pg_seq=pg)
        sent = {"sent": sent} if sent is not None and self.spec.log_sent else {}
        self._add("collective", step, **fields, stage="enqueue", **sent)
        if body is not None:
            body()
        if done:
            agreed = {"agreed": agreed} if agreed is not None and self.spec.log_agreed else {}
            self._add("collective", step, **fields, stage="done", **agreed)

    def _agreement(self, step, phase, sent_tokens, graph_mode, agreed, *, done=True) -> None:
        sent = {"step_id": step, "phase": phase, "status": 0, "num_tokens": sent_tokens,
                "graph_mode": graph_mode, "uniform_token_count": 0, "num_reqs": int(sent_tokens > 0)}
        self._collective(step, "dp", "all_reduce", phase, [list(wire_shape(phase, self.spec.dp_size))], sent=sent,
                         agreed=agreed, done=done)

    def _expert(self, step, op, phase, rows, body=None) -> None:
        if self.spec.expert_collectives:
            self._collective(step, "expert", op, phase, [[rows]], body=body)
        elif body is not None:
            body()

    def _buffers(self, step, reason, *, write=True, moved=False) -> None:
        self.version += 2 if write else 0
        snapshot = {name: {"ptr": ptr + (0x40 if moved and name == "input_ids" else 0),
                           "shape": _SHAPES.get(name, [64]), "version": self.version}
                    for name, ptr in self.ptrs.items()}
        self._add("buffers", step, reason=reason, buffers=snapshot)

    # -- a run ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.spec.job_shape:
            hosts = self.spec.hosts
            by_host = {h: [r for r, on in enumerate(hosts) if on == h] for h in hosts} if hosts else None
            named_k = {"num_speculative_tokens": self.spec.spec_tokens} if self.spec.job_names_k else {}
            self._add("job", None, **job_shape_fields(self.spec.dp_size, self.spec.pcp_size, self.dp_rank,
                                                      self.pcp_rank, tp_size=self.spec.tp_size,
                                                      tp_rank=self.tp_rank,
                                                      host=hosts[self.global_rank] if hosts else "synth",
                                                      hosts=by_host, **named_k))
        if self.spec.graphs:
            for size in CAPTURE_SIZES:
                self._add("graph", -1, action="capture", num_tokens=size, backend="static")
                self._buffers(-1, "capture")
        self._transition(-1, "capture", "init", "capturing")
        self._transition(-1, "captured", "capturing", "ready")

    def step(self, step: int) -> bool:
        """The records of one step; False when this rank's log ends in it."""
        if self.has("missing_replica", step):
            return True
        if self.has("hang", step):
            return False  # never arrives: the log ends with the previous step
        work, sent, counts, graph, all_idle = self.schedule.facts(step)
        kind, me = work[self.dp_rank], self.dp_rank
        wants_graph = 2 if self.spec.graphs and kind != "prefill" and not self.has("graph_demoted", step) else 0
        if ("hang", step) in self.peer_defects or self.has_any("truncated", step):
            self._agreement(step, 1, sent[me], wants_graph, None, done=False)
            return False  # waits in the agreement: the log ends on its `enqueue`
        if self.has("pg_seq", step):
            self.pg["dp"] += 1  # a DP collective ran without a record
        agreed = self.schedule.agreed(step, 1, counts, graph, all_idle)
        if self.has("agreed_mismatch", step):
            agreed["num_tokens_across_dp"][me] += 1
        self._agreement(step, 1, sent[me], wants_graph, agreed)
        state = {"idle": "idle_dummy"}.get(kind, kind)
        if self.has("fault", step) or ("fault", step) in self.peer_defects:
            return self._fault(step, kind, state)
        if self.has_any("deadlock", step):
            return self._deadlock(step, kind, counts[me])
        if not all_idle:
            self._forward(step, kind, max(1, counts[me]), graph)
        dst = state
        if self.has("illegal_transition", step):  # the step's trigger logged with a wrong dst
            dst = "decode" if kind == "prefill" else "prefill"
        self._transition(step, kind, "ready", dst)
        if self.spec.spec_tokens > 0:
            self._draft(step, sent, all_idle)
            self._transition(step, "draft", state, "draft_sync")
            state = "draft_sync"
        if self.has("extra_draft_pass", step):
            self._agreement(step, 3, 1, 0, None, done=False)
            return False
        if self.spec.decisions:
            self._add("transition", step, trigger="finish", src=state, dst="ready", outcome="ok",
                      **self._decided(step, kind, sent, counts, graph, all_idle))
        else:
            self._transition(step, "finish", state, "ready")
        if self.has_any("extra_draft_pass", step):  # the peers' next agreement: they wait in it
            self._agreement(step + 1, 1, 0, 0, None, done=False)
            return False
        return True

    def _decided(self, step, kind, sent, counts, graph, all_idle) -> dict:
        """The step's decisions, as every rank of the replica takes them (but a RANK_DEFECTS rank)."""
        me, real = self.dp_rank, kind != "idle"
        rows = 0 if all_idle else max(1, counts[me])
        graph_rows = rows if graph else 0
        if self.has("rank_graph_mode", step):
            graph_rows = 0 if graph_rows else rows
        tokens = zlib.crc32(b"%d:%d:%d" % (step, me, self.has("rank_tokens", step))) if real else 0
        decided = StepDecisions(real, zlib.crc32(b"%d:%s" % (me, kind.encode())) if real else 0,
                                sent[me], rows, graph_rows, 0 if all_idle else self.spec.spec_tokens, tokens)
        digest, changed = self.decision_log.entry(decided)
        return {DIGEST_FIELD: digest, **({DECISIONS_FIELD: changed} if changed else {})}

    def _forward(self, step, kind, rows, graph) -> None:
        if not self.has("stale_buffer_replay", step):
            self._buffers(step, "dummy" if kind == "idle" else "real")
        if self.spec.model_collectives and self.spec.pcp_size > 1:
            self._collective(step, "pcp", "all_gather", 0, [[rows, 16]])
        if self.has("skip_dummy_forward", step):
            return  # agreed, then ran no forward: its peers wait in the expert exchange

        def replay() -> None:
            self._buffers(step, "replay", write=False, moved=self.has("moved_buffer", step))
            self._add("graph", step, action="replay", num_tokens=rows, backend="static")

        self._expert(step, "forward", 1, rows, replay if graph else None)

    def _draft(self, step, sent, all_idle) -> None:
        if self.has("collective_mismatch", step):
            return  # the skipped draft agreement of DESIGN section 1
        me = self.dp_rank
        rows = [n + 1 if n else 0 for n in sent]  # the replicated draft runs the global batch
        self._agreement(step, 2, rows[me], 0, self.schedule.agreed(step, 2, rows, False, all_idle))
        if not all_idle:
            self._expert(step, "draft_prefill", 2, max(1, rows[me]))
        if self.spec.spec_tokens > 1:
            reqs = [int(n > 0) for n in sent]
            self._agreement(step, 3, reqs[me], 0, self.schedule.agreed(step, 3, reqs, False, all_idle))
            if not all_idle:
                for _ in range(self.spec.spec_tokens - 1):
                    self._expert(step, "draft_decode", 3, max(1, reqs[me]))

    def _deadlock(self, step, kind, rows) -> bool:
        """The idle replica skips its dummy forward and waits in the draft agreement, while its
        peers wait for it in the expert exchange: the logs end there."""
        self._buffers(step, "dummy" if kind == "idle" else "real")
        if self.has("deadlock", step):
            self._transition(step, kind, "ready", "idle_dummy")
            self._agreement(step, 2, 0, 0, None, done=False)
        else:
            self._collective(step, "expert", "forward", 1, [[max(1, rows)]], done=False)
        return False

    def _fault(self, step, kind, state) -> bool:
        if self.has("fault", step):  # a bad batch, caught before the state changed
            self._transition(step, kind, "ready", "ready", "error")
            self._add("fault", step, error="BatchError", message=f"dp_rank {self.dp_rank}: batch rejected")
            self._transition(step, "fault", "ready", "faulted")
        else:
            self._transition(step, kind, "ready", state, "error")
            self._add("fault", step, error="ReplicaFault", message=f"dp_rank {self.dp_rank}: a peer aborted")
            self._transition(step, "fault", state, "faulted")
        return False

    def finish(self, step: int) -> None:
        self._transition(step, "shutdown", "ready", "stopped")


def write_run(run_dir: str | os.PathLike[str], spec: SynthSpec = SynthSpec(),
              defects: Sequence[Defect] = (), *, ranks: Sequence[int] | None = None) -> Path:
    """Write `rank-<g>.jsonl` for every rank of `spec` (or of `ranks`) into `run_dir`
    (created); return it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    schedule = _Schedule(spec, defects)
    per_replica = spec.pcp_size * spec.tp_size
    for rank in (range(spec.dp_size * per_replica) if ranks is None else ranks):
        path = write_rank_log(run_dir, spec, _RankWriter(spec, schedule, rank, defects))
        if any(d.kind == "truncated" and rank == d.replica * per_replica for d in defects):
            truncate_last_line(path)
    return run_dir


def truncate_last_line(path: str | os.PathLike[str], keep: float = 0.5) -> None:
    """Cut the file's last line to `keep` of its length, newline included: a SIGKILL mid-write."""
    data = Path(path).read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    os.truncate(path, start + int((len(data) - start) * keep))
