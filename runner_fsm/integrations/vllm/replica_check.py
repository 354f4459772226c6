"""A replica's ranks agree with each other (DESIGN section 11), through vLLM: the drafter's gate,
rank faults, and the opt-in online `consensus` check.

- **The drafter's gate** (always, where the runner's adapter can gate its drafter: MRV2's
  speculator). Each rank decides alone whether its drafter runs this step; where two ranks of a
  replica decide otherwise, the one that drafts waits in a TP collective its peer never joins
  (vLLM #49027). So the decision is logged (`gate` record) *before* any drafter collective: it is
  the evidence replay compares (`rules.consensus`), which no `finish` of that step will carry.
- **`tp-skip-draft@replica=R,step=S,rank=K`**: rank K's gate alone says no at step S.
- **`consensus`** (worker option, off by default): the ranks of the replica exchange [step,
  gate] at each gate (before the drafter's collectives, so a
  disagreement stops every rank with a `DesyncError` instead of a hang) and [step, decision
  digest, decisions] after each step's `finish`, by the rule replay applies
  (`step_consensus.disagreement`); through shared memory where the replica's ranks share a host
  (`shm_exchange`), else gloo. Its timeout is `collective_timeout_s`: a rank that never reaches
  the check fails its peers' wait instead of holding it for ever.

A replica of one rank has nothing to compare: `for_worker` returns None.
"""

from __future__ import annotations

import datetime
import itertools

from runner_fsm.agree.consensus import consensus_row, disagreement
from runner_fsm.agree.shm_exchange import replica_exchange
from runner_fsm.audit.decisions import StepDecisions
from runner_fsm.audit.shape import coords_of
from runner_fsm.errors import DesyncError
from runner_fsm.integrations.vllm.common import inject
from runner_fsm.integrations.vllm.common.inject import VLLMInjector

REPLICA_GROUP = "replica"  # the exchanges' group in the log: every rank of one replica
TARGET_PHASE = 1  # `dp.TARGET`: the exchanges belong to the step, not to a draft pass


def replica_ranks(place) -> list[int]:
    """The global ranks of `place`'s replica, in vLLM's order."""
    size = place.sizes.pp * place.sizes.pcp * place.sizes.tp
    return list(range(place.coords.dp * size, (place.coords.dp + 1) * size))


def logged_groups(place, consensus: bool) -> dict[str, list[int]]:
    """For the `job` record: the group the online check's exchanges are logged in, if any."""
    ranks = replica_ranks(place)
    return {REPLICA_GROUP: ranks} if consensus and len(ranks) > 1 else {}


class ReplicaCheck:
    def __init__(self, recorder, *, place, injection=None, consensus: bool = False, timeout_s: float = 120.0):
        self.recorder, self.place = recorder, place
        sizes = place.sizes
        self.size = sizes.pp * sizes.pcp * sizes.tp
        self.rank_in_replica = place.global_rank - place.coords.dp * self.size
        self.injector = VLLMInjector(injection, place.coords.dp, rank=self.rank_in_replica,
                                     on_fire=lambda: recorder.audit.injected(recorder.step_id, str(injection)))
        self.gate_installed: str | None = "not attached"  # None once the gate is in place, else why not
        # two exchanges over one group (a row's width each): shared memory where the replica's
        # ranks share a host, else gloo (`shm_exchange`)
        self.exchange = self.gate_exchange = None
        self._pg_seq = itertools.count()  # the `replica` group's exchanges, as the log numbers them
        if consensus:
            group = self._replica_group(timeout_s)
            self.gate_exchange = replica_exchange(group, 2, timeout_s)
            self.exchange = replica_exchange(group, len(consensus_row(0, StepDecisions(True, 0, 0, 0, 0, 0))), timeout_s)

    @classmethod
    def for_worker(cls, worker) -> "ReplicaCheck | None":
        """For a vLLM worker whose groups exist; None in a replica of one rank."""
        place = worker.place
        sizes = place.sizes
        if sizes.pp * sizes.pcp * sizes.tp == 1:
            return None
        opts = worker.fsm_options
        injection = inject.parse(opts.inject) if opts.inject else None
        if injection is not None and (injection.kind not in inject.RANK_KINDS or injection.kind in inject.GRAPH_KINDS):
            injection = None  # the DP support's (`dp/support.py`) or a graph replay's (`graph_faults`)
        return cls(worker.recorder, place=place, injection=injection, consensus=opts.consensus,
                   timeout_s=opts.collective_timeout_s)

    def _replica_group(self, timeout_s: float):
        """A gloo group of this replica's ranks (only they create it), for the online check."""
        import torch.distributed as dist

        return dist.new_group(replica_ranks(self.place), backend="gloo",
                              timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)

    def attach(self, adapter) -> None:
        """Once the model (and the drafter) exist: the gate around the drafter's passes, and the
        check of each step's decisions right after the recorder ends it."""
        self.gate_installed = adapter.install_draft_gate(self._gate)
        if self.exchange is not None:
            self.recorder.after_end = self.after_step

    # -- the drafter's gate --------------------------------------------------------------

    def _gate(self, dummy: bool, steps: int) -> int:
        """Before a drafter pass: the drafter steps to run (0: skip it), logged first."""
        rec = self.recorder
        if not rec.in_step:
            return steps  # warm-up and profiling passes are no step's
        if self.injector.due("tp-skip-draft", rec.step_id):
            steps = 0
        rec.gate(steps)
        if self.gate_exchange is not None:
            rows = self._logged(self.gate_exchange, "gate", [rec.step_id, steps], rec.step_id)
            if len({tuple(row) for row in rows}) > 1:
                raise DesyncError(f"replica {self.place.coords.dp}, step {rec.step_id}: {self._gates_differ(rows)}"
                                  " (online consensus, before the drafter's collectives)")
        return steps

    def _gates_differ(self, rows: list[list[int]]) -> str:
        from runner_fsm.audit.decisions import outvoted

        if len({row[0] for row in rows}) > 1:
            return "its ranks are at different steps (" + ", ".join(
                f"{self._rank_text(i)}: {row[0]}" for i, row in enumerate(rows)) + ")"
        reference, odd, majority = outvoted({i: row[1] for i, row in enumerate(rows)})
        whose = "" if majority else " (no majority: which one is wrong is not known)"
        return (f"{self._rank_text(odd)} decided draft={rows[odd][1]} at its drafter's gate where"
                f" {self._rank_text(reference)} decided draft={rows[reference][1]}{whose}")

    # -- every step's decisions ----------------------------------------------------------

    def after_step(self) -> None:
        """After the step's `finish` record (which carries its digest): compare across the replica."""
        decided = self.recorder.decided
        if self.exchange is None or decided is None:
            return
        step = self.recorder.step_id - 1  # `end_step` moved on
        rows = self._logged(self.exchange, "decisions", consensus_row(step, decided), step)
        problem = disagreement(rows, step, self._rank_text)
        if problem is not None:
            raise DesyncError(f"replica {self.place.coords.dp}, step {step}: {problem}")

    def _logged(self, exchange, op: str, row: list[int], step: int) -> list[list[int]]:
        """One exchange among the replica's ranks, logged like every collective (group
        `replica`, the job record lists its members): a rank that never joins it is seen."""
        audit, seq = self.recorder.audit, next(self._pg_seq)
        audit.collective(step, REPLICA_GROUP, op, TARGET_PHASE, [[len(row)]], seq, "enqueue")
        rows = exchange(row)
        audit.collective(step, REPLICA_GROUP, op, TARGET_PHASE, None, seq, "done")
        return rows

    def never_fired(self, last_step: int) -> str | None:
        return self.injector.never_fired(last_step)

    def _rank_text(self, index: int) -> str:
        """The index-th rank of this replica (its group's order: vLLM's), with its coordinates."""
        sizes = self.place.sizes
        global_rank = self.place.coords.dp * self.size + index
        return f"rank {global_rank} ({coords_of(global_rank, sizes).text(sizes)})"
