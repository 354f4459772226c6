"""The DP agreement, carried inside vLLM's own DP all-reduce, whichever model runner issues it.

Each runner agrees on DP padding in one all-reduce of an int32 `[rows, dp]` tensor, one column per
rank (V1: `_run_ar`, `runners/v1_dp.py`; Model Runner V2: `sync_cudagraph_and_dp_padding`,
`runners/mrv2_dp.py`). `AgreementTap.exchange` appends this replica's agreement rows
(`AGREEMENT_ROWS`) to that same tensor, so the one collective vLLM already issues carries the
agreement too (no extra collective, and a replica that skips one is caught in the next, by every
rank at once). The gathered columns are checked with the project's rule (`dp.agree`), every rank
raises the same `DesyncError`/`ReplicaFault`, and vLLM gets back exactly the rows it built.

Phases come from where the sync is reached, which the runner's adapter tells: a tag around the
call (`tagged`: V1's target and drafter syncs) or `phase_source` (MRV2). A drafter's first sync
in a step is DRAFT_PREFILL, DRAFT_DECODE after that (`draft_phase`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from runner_fsm import dp
from runner_fsm.agree.order import out_of_order
from runner_fsm.errors import DesyncError, ReplicaFault

AGREEMENT_ROWS = ("step_id", "phase", "seq", "kind", "status")
KIND_REAL, KIND_DUMMY = 0, 1
KIND_NAMES = {KIND_REAL: "real", KIND_DUMMY: "dummy"}
NO_STEP = -1  # before the worker's first step (warm-up, profiling): agreed but not audited


@dataclasses.dataclass(frozen=True)
class AgreementRows:
    """What one replica appends to vLLM's DP all-reduce; identical on every rank when in step."""

    step_id: int
    phase: int
    seq: int  # the replica's count of DP agreements so far: catches a skipped one within a phase
    kind: int  # KIND_REAL or KIND_DUMMY (an idle replica's step)
    status: int = dp.STATUS_OK

    def column(self) -> tuple[int, ...]:
        return (self.step_id, self.phase, self.seq, self.kind, self.status)


def check_columns(ours: list[list[int]], num_tokens: list[int], graph_modes: list[int], *,
                  last_phase: int | None = None) -> dp.DPSyncState:
    """The project's agreement rule over gathered columns: `ours` are the AGREEMENT_ROWS,
    `num_tokens` and `graph_modes` the rows of vLLM's tensor that hold each replica's dispatch
    count and graph mode (0 = eager); `last_phase`, the last phase of a step (from K, the same on
    every replica), names a replica that ran a draft pass no step has (`agree.order`, rule 0).

    `dp.agree` judges status, step and phase; a sequence mismatch (same step and phase, but one
    replica issued an extra or skipped agreement) is a desync too. A desync names its culprit
    replica and step: the odd one out when a majority agrees, else the replica(s) furthest along
    (they ran past an agreement their peers are still in), at the step of the ones behind.
    """
    step, phase, seq, _kind, status = ours
    columns = [dp.LocalDispatch(step_id=step[r], phase=phase[r], status=status[r], num_tokens=num_tokens[r],
                                graph_mode=dp.GRAPH_FULL if graph_modes[r] else dp.GRAPH_EAGER)
               for r in range(len(step))]
    try:
        agreed = dp.agree(columns)
    except DesyncError as exc:
        raise _named(exc, list(zip(step, phase, seq)), last_phase) from None
    if min(seq) != max(seq):
        raise _named(DesyncError(f"DP desync: replicas agree on step {step[0]} {dp.phase_name(phase[0])}"
                                 f" but not on the agreement sequence number (sent {seq})",
                                 sent=dict(enumerate(zip(step, phase)))), list(zip(step, phase, seq)), last_phase)
    return agreed


def _named(exc: DesyncError, sent: list[tuple[int, int, int]], last_phase: int | None = None) -> DesyncError:
    """`exc` with its culprit named by the rule the embedded engine and replay apply
    (`agree.order`: a phase past the step's last, a majority, else the replica ahead in
    (step, phase, sequence), else a tie)."""
    found = out_of_order(dict(enumerate(sent)), last_phase=last_phase)
    each = ", ".join(f"replica {r} sent step {s} {dp.phase_name(p)} seq {q}" for r, (s, p, q) in enumerate(sent))
    message = f"{found.describe()} (DP desync in vLLM's DP all-reduce: {each}). {exc}"
    return DesyncError(message, sent=getattr(exc, "sent", None), culprits=found.culprits, culprit_step=found.step)


class AgreementTap:
    """This replica's side of the agreement rows, exchanged inside vLLM's DP sync (`exchange`).

    `audit` is the replica's AuditLog (or None); `beat(step, phase, collective)` records the
    replica's position for the watchdog; `rows_hook(rows)` lets fault injection alter what
    this replica sends (it returns the rows to send).
    """

    def __init__(self, dp_rank: int, dp_size: int, *, audit=None,
                 beat: Callable[[int, int, str], None] | None = None,
                 rows_hook: Callable[[AgreementRows], AgreementRows] | None = None,
                 position: Callable[[], tuple[int, bool]] | None = None,
                 enqueue_extra: Callable[[AgreementRows], dict] | None = None):
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.audit, self._beat, self._rows_hook = audit, beat, rows_hook
        self._position = position  # () -> (step id or NO_STEP, dummy?): the worker's step
        self._enqueue_extra = enqueue_extra  # more fields for an enqueue record (the dispatch inputs)
        self.step_id, self.kind = NO_STEP, KIND_REAL
        self.phase = 0  # set by a tag around the runner's sync (`tagged`: V1)
        # MRV2: no per-phase method to tag; the runner adapter tells the phase of a sync instead.
        self.phase_source: Callable[[], int] | None = None
        self.seq = 0
        self.draft_syncs = 0  # drafter syncs in this step: the first is DRAFT_PREFILL
        self.joined_target = NO_STEP  # the last step whose TARGET agreement this replica entered
        self.last_phase: int | None = None  # the last phase of a step, when the drafter's K is known
        self._status = dp.STATUS_OK
        # The collective that carries the rows, `(tensor, group) -> None`, in place; None: a SUM
        # `torch.distributed.all_reduce` (the runner's sync makes that one; MRV2 on vLLM 0.33 sets
        # vLLM's own `cpu_all_reduce_`, which its sync makes: `runners/mrv2_dp.install`).
        self.all_reduce: Callable | None = None

    def begin_step(self, step_id: int, *, dummy: bool) -> None:
        self.step_id, self.kind, self.draft_syncs = step_id, KIND_DUMMY if dummy else KIND_REAL, 0

    def follow(self) -> None:
        """Take the step from the worker's `position`, when one was given."""
        if self._position is not None:
            step_id, dummy = self._position()
            if step_id != self.step_id:
                self.begin_step(step_id, dummy=dummy)
            self.kind = KIND_DUMMY if dummy else KIND_REAL

    @contextlib.contextmanager
    def tagged(self, phase: int):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def draft_phase(self) -> int:
        self.follow()
        self.draft_syncs += 1
        return dp.DRAFT_PREFILL if self.draft_syncs == 1 else dp.DRAFT_DECODE

    def exchange(self, tensor: torch.Tensor, group, *, device="cpu", num_tokens_row: int, graph_row: int,
                 log_column: bool = True, decide=None) -> torch.Tensor:
        """All-reduce vLLM's `tensor` (this rank's column filled) with the agreement rows below
        it, check them, and return vLLM's rows summed (a new tensor on `device`).

        Logged (`enqueue`): the count sent (`sent.num_tokens`), vLLM's own column (`sent.vllm`,
        where `log_column`), the agreement rows (`sent.rows`) only where they are not the
        record's own step, phase, pg_seq, kind and an ok status (a desync, an abort), and
        `kind: dummy` for an idle replica's step; (`done`) the agreed state. The gathered
        columns and vLLM's decision from them are no evidence of their own (the agreed state
        and each rank's column are), so they stay out of the log. `decide(vllm_rows)`: the
        runner's own graph decision (requested and agreed graph mode, padded counts), which
        replaces the rule's in the `done` record where the runner gives one."""
        self.follow()
        phase = self.phase or (self.phase_source() if self.phase_source is not None else dp.TARGET)
        rows = AgreementRows(self.step_id, phase, self.seq, self.kind, self._status)
        if rows.phase == dp.TARGET:
            self.joined_target = self.step_id
        if self._rows_hook is not None:
            rows = self._rows_hook(rows)
        self.seq += 1
        n = tensor.shape[0]
        ours = torch.zeros(len(AGREEMENT_ROWS), self.dp_size, dtype=tensor.dtype)
        ours[:, self.dp_rank] = torch.tensor(rows.column(), dtype=tensor.dtype)
        carried = torch.cat([tensor.cpu(), ours]).to(device)
        vllm_column = tensor[:, self.dp_rank].tolist()
        sent = {"num_tokens": vllm_column[num_tokens_row]}
        if log_column:
            sent["vllm"] = vllm_column
        logged = rows.step_id if rows.step_id != NO_STEP else None  # the step this replica reported
        if logged is None or rows.column() != (logged, rows.phase, rows.seq, self.kind, dp.STATUS_OK):
            sent["rows"] = rows.column()
        more = self._enqueue_extra(rows) if self._enqueue_extra is not None else {}
        if rows.kind == KIND_DUMMY:
            more["kind"] = KIND_NAMES[KIND_DUMMY]
        self._record(logged, rows, "enqueue", [[n + len(AGREEMENT_ROWS), self.dp_size]], sent=sent, **more)
        if self.all_reduce is None:
            dist.all_reduce(carried, group=group)
        else:
            self.all_reduce(carried, group)
        gathered = carried.cpu().tolist()
        vllm_rows = gathered[:n]
        agreed = check_columns(gathered[n:], vllm_rows[num_tokens_row], vllm_rows[graph_row],
                               last_phase=self.last_phase)  # raises alike everywhere
        fields = dataclasses.asdict(agreed)
        if decide is not None:
            fields.update(decide(vllm_rows))
        self._record(logged, rows, "done", [[n + len(AGREEMENT_ROWS), self.dp_size]], agreed=fields)
        return carried[:n].clone()

    def abort(self, status: int, group, *, vllm_rows: int, device="cpu") -> bool:
        """Join this step's TARGET agreement with `status`, so that peers waiting in it stop with
        `ReplicaFault` naming this replica; False (nothing sent) when this replica already
        entered it or runs no step (peers are past it: the watchdog stops them instead)."""
        self.follow()
        if self.step_id == NO_STEP or self.joined_target == self.step_id:
            return False
        self._status = status
        try:
            with self.tagged(dp.TARGET):
                self.exchange(torch.zeros(vllm_rows, self.dp_size, dtype=torch.int32), group, device=device,
                              num_tokens_row=0, graph_row=0)
        except ReplicaFault:
            pass  # our own abort, as every peer sees it
        finally:
            self._status = dp.STATUS_OK
        return True

    def _record(self, step_id, rows: AgreementRows, stage: str, shapes, **extra) -> None:
        if self._beat is not None and step_id is not None:
            self._beat(step_id, rows.phase, f"dp all_reduce #{rows.seq}" if stage == "enqueue" else "")
        if self.audit is not None and step_id is not None:
            self.audit.collective(step_id, "dp", "all_reduce", rows.phase, shapes, rows.seq, stage, **extra)
