"""The DP agreements of one DP group paired as gloo paired them, by `pg_seq`: when the members
met in one agreement with different (step, phase), `agree.order` names the replica out of
order, the rule the online check (`dp.agree`) applies to the same keys.

`sequences` sees a skipped agreement inside one step (one member issued fewer); the pairing
sees what each member sent to the collective they shared, which may lie one step apart on the
two sides (the replica that skipped its draft agreements meets its peers' DRAFT_PREFILL with
its next step's TARGET). Nothing is kept while every member of a step issued the same DP
agreements from the same count; an agreement left unpaired (a peer died or hung before it, or
aborted it: a non-ok status is no desync) is dropped after `WINDOW` steps. A rank named once
(or known to have missed a step: `missing_replica`) is paired no more: its count is out of
step with its peers' from then on, and one skip is one verdict.
"""

from __future__ import annotations

from typing import Callable

from runner_fsm.agree.order import key_text, out_of_order
from runner_fsm.rules.rank_steps import RankStep
from runner_fsm.rules.ranks import Groups
from runner_fsm.rules.verdicts import Verdict

WINDOW = 2  # steps an agreement waits for its peers' (a skip puts the two sides one step apart)


class AgreementPairs:
    def __init__(self, groups: Groups, emit: Callable[[Verdict], None]):
        self.groups = groups
        self.emit = emit
        self._open: dict[tuple, dict[int, tuple]] = {}  # (instance, pg_seq) -> {rank: (step, phase)}
        self._opened_at: dict[tuple, int] = {}
        self._unpaired: set[int] = set()  # ranks out of step: see the module docstring

    def forget(self, rank: int) -> None:
        """`rank` is out of step from now on: never pair it again."""
        self._unpaired.add(rank)
        for slot in [s for s, sent in self._open.items() if rank in sent]:
            del self._open[slot], self._opened_at[slot]

    def check(self, step: int, present: dict[int, RankStep]) -> None:
        if not self._open and _in_step(present, len(self.groups.infos)):
            return  # the common case: every rank issued the same collectives
        for rank, summary in present.items():
            first = summary.first_pg_of("dp")
            if summary.aborted or not isinstance(first, int) or rank in self._unpaired:
                continue
            instance = self.groups.instance("dp", rank)
            for index, (_op, phase, _shapes) in enumerate(summary.keys("dp")):
                if rank in self._unpaired:  # named by the previous pairing
                    break
                slot = (instance, first + index)
                sent = self._open.setdefault(slot, {})
                self._opened_at.setdefault(slot, step)
                sent[rank] = (summary.step, phase)
                if all(r in sent or r in self._unpaired for r in self.groups.members("dp", instance)):
                    del self._open[slot], self._opened_at[slot]
                    self._judge(sent)
        for slot in [s for s, opened in self._opened_at.items() if opened < step - WINDOW]:
            del self._open[slot], self._opened_at[slot]

    def _judge(self, sent: dict[int, tuple]) -> None:
        by_replica = {self.groups.replica(rank): key for rank, key in sent.items()}
        found = out_of_order(by_replica, last_phase=self.groups.last_phase)
        if found is None:
            return
        each = ", ".join(f"replica {replica} sent {key_text(key)}" for replica, key in found.sent)
        what = f"its DP agreement met its peers' with another step or phase ({each}): {found.describe()}"
        if found.tie:
            first = min(key[0] for key in by_replica.values())
            self.emit(Verdict("collective_mismatch", None, first, f"replicas {what}", tuple(sorted(sent))))
            for rank in sent:
                self.forget(rank)
            return
        for rank, key in sorted(sent.items()):
            replica = self.groups.replica(rank)
            if replica in found.culprits:
                self.emit(Verdict("collective_mismatch", replica, found.step, f"replica {replica}: {what}", (rank,)))
                self.forget(rank)


def _in_step(present: dict[int, RankStep], ranks: int) -> bool:
    """Every rank present, none aborted, each with the same collectives. (Counts that differ
    while the collectives match are `sequences`' finding: a record lost, not a desync.)"""
    if len(present) < ranks:
        return False
    summaries = iter(present.values())
    first = next(summaries)
    signature = first.signature
    return not first.aborted and all(
        not other.aborted and (other.signature is signature or other.signature == signature)
        for other in summaries)
