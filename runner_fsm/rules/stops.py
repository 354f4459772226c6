"""A stop you asked for reads clean; a death never does (DESIGN section 11, "A stop is a record").

A rank writes a `stop` record the moment a stop request reaches it (SIGINT or SIGTERM, through
`stop_signals`; the engine's shutdown call). A job's stop is clean when every rank whose log
ends without `shutdown` has its end explained by a request:

- it recorded one itself, and ended after it (between steps, mid-step or in a collective: what
  a stop request leads to, including vLLM's force-kill of its workers);
- its log goes on after a request another rank of its host recorded (it was alive when the job
  was told to stop);
- it waits in a collective whose culprits (the peers that never came: `hang`) all ended so:
  a rank blocked in a collective (C++) runs no Python signal handler before it is killed, and
  its peers' records of the stop cover it;
- it waits in a collective every member issued, one of which recorded the request in that
  step (waiting in it too, or past it and waiting in no other).

A stop request is also recorded where it started (`OriginStop`: vLLM's front process, before
vLLM's shutdown began), with the ranks whose process was alive at that moment: each of those
ended in the shutdown that followed, whatever it managed to record itself (vLLM's default
shutdown kills workers a few lines after the request, and one the kernel did not schedule in
between records nothing). That evidence needs no clock.

A fault a rank logged because a peer left in the stop is its consequence too, even where no
clock orders the two (the peer on another host): a lost connection (reset or closed by the
peer) at a step no earlier than the step that peer's end, explained by a request, came at
(less one: a rank may wait a step ahead). The faults that follow it on the same rank, and that
rank's end, are its consequences as well.

Then the `unfinished`, `hang` and `missing_replica` verdicts of those ends, and the faults a
rank logged after a request (an interrupted step, a peer's closed connection), become one note
naming the stop. A log that ends with no stop request anywhere in the job before it is a death:
its verdicts stay, whatever step it ends at. A stop recorded after a fault on its host is no
request: the job was failing already, and vLLM's shutdown of it (or the launcher's) explains
nothing. Times are compared only within a host
(`t_ns` is the host's monotonic clock; the `job` record's `host`, where a writer names it).
"""

from __future__ import annotations

import re

from runner_fsm.rules.facts import FaultSeen, OriginStop, RunFacts, StopSeen
from runner_fsm.rules.verdicts import Verdict

END_KINDS = frozenset({"unfinished", "hang", "missing_replica"})  # verdicts about where a log ends
# A peer's end as the transports word it (gloo, the kernel): the connection went with the process.
LOST_PEER = re.compile(r"reset by peer|closed by peer|connection (was )?(reset|closed)|broken pipe|ECONNRESET|EPIPE",
                       re.IGNORECASE)


class StopRule:
    """Which ranks' ends and faults the job's stop requests explain."""

    def __init__(self, facts: RunFacts):
        self.facts = facts
        # A stop recorded after a fault on its host is vLLM (or the launcher) ending a job that
        # was failing already, not a request: it explains nothing.
        # The same for a request recorded at its origin: one after a fault on its host explains nothing.
        self.origins = [o for o in facts.origins
                        if not any(f.t_ns < o.t_ns and facts.hosts.get(f.rank) == o.host for f in facts.faults)]
        self.requests = [s for s in facts.stops if self._asked(s)
                         and not any(f.t_ns < s.t_ns and self._same_host(f.rank, s.rank) for f in facts.faults)]
        self.own: dict[int, StopSeen] = {}
        for stop in sorted(self.requests, key=lambda s: s.seq):
            self.own.setdefault(stop.rank, stop)
        self.alive_at_request = frozenset().union(*(o.alive for o in self.origins))
        self.consequences = self._lost_peer_faults()

    def _asked(self, stop: StopSeen) -> bool:
        """A SIGTERM a vLLM worker records is vLLM's own teardown as often as a user's request
        (the executor SIGTERMs its workers however the engine ends): where the rank's front
        records requests (`stop_front`), one counts only after its front recorded one on its host."""
        if stop.signal != "SIGTERM" or stop.rank not in self.facts.fronted:
            return True
        host = self.facts.hosts.get(stop.rank)
        return any(o.host == host and o.t_ns <= stop.t_ns for o in self.origins)

    def _same_host(self, a: int, b: int) -> bool:
        hosts = self.facts.hosts
        return hosts.get(a) == hosts.get(b)

    @property
    def asked(self) -> bool:
        return bool(self.requests or self.origins)

    def request_before(self, rank: int, t_ns: int | None) -> StopSeen | OriginStop | None:
        """The first stop request recorded on `rank`'s host no later than `t_ns` (its clock)."""
        if t_ns is None:
            return None
        host = self.facts.hosts.get(rank)
        found = [s for s in self.requests if s.t_ns <= t_ns and self._same_host(s.rank, rank)]
        found += [o for o in self.origins if o.t_ns <= t_ns and o.host == host]
        return min(found, key=lambda s: s.t_ns, default=None)

    def ended_on_request(self, rank: int) -> bool:
        """Its end is explained by a request itself: its own, alive when one was recorded at its
        origin, or its log going on after one on its host."""
        if rank in self.own or rank in self.alive_at_request:
            return True
        end = self.facts.ends.get(rank)  # no request, no time wanted (a seek's is counted: `facts.RankEnd`)
        return end is not None and self.asked and self.request_before(rank, end.t_ns) is not None

    def explains_end(self, rank: int) -> bool:
        """Ended on a request, or after a fault that was a consequence of one (`consequences`)."""
        return self.ended_on_request(rank) or any(f.rank == rank for f in self.consequences)

    def explains_fault(self, fault: FaultSeen) -> bool:
        own = self.own.get(fault.rank)
        return (own is not None and own.seq < fault.seq) or self.request_before(fault.rank, fault.t_ns) is not None \
            or fault in self.consequences

    def _lost_peer_faults(self) -> frozenset[FaultSeen]:
        """Faults that follow a peer's end in the stop, by steps, not clocks (module docstring):
        the first fault of a rank that lost a connection to a peer which ended on a request at
        that step or the next, and the faults after it on that rank."""
        ends = self.facts.ends
        left = [r for r in ends if self.ended_on_request(r)]
        out: set[FaultSeen] = set()
        by_rank: dict[int, list[FaultSeen]] = {}
        for fault in sorted(self.facts.faults, key=lambda f: f.seq):
            by_rank.setdefault(fault.rank, []).append(fault)
        for rank, faults in by_rank.items():
            first = faults[0]
            if first.step is None or not LOST_PEER.search(first.detail):
                continue
            if any(peer != rank and ends[peer].step <= first.step + 1 for peer in left):
                out.update(faults)
        return frozenset(out)

    def left_on_request(self, rank: int) -> bool:
        """The rank recorded a stop request and no fault of its own before it: whatever it
        left, it left because of the stop (not, say, on a peer's closed connection)."""
        own = self.own.get(rank)
        return own is not None and not any(f.rank == rank and f.seq < own.seq for f in self.facts.faults)

    def waiting(self, hang: Verdict) -> list[int]:
        """The ranks a `hang` verdict finds waiting in its collective (its `ranks` are the culprits)."""
        return sorted(r for r, end in self.facts.ends.items()
                      if end.in_collective and end.step == hang.step and r not in hang.ranks)

    def explains_hang(self, hang: Verdict) -> bool:
        """Its culprits' ends are explained, and so is each waiter's: by itself, or because every
        culprit left the collective on the stop request (a waiter blocked in C++ records nothing);
        or every member was in it when one of them recorded the request (`stopped_inside`)."""
        culprits_left = all(map(self.left_on_request, hang.ranks))
        return (all(map(self.explains_end, hang.ranks))
                and all(culprits_left or self.explains_end(rank) for rank in self.waiting(hang))) \
            or self.stopped_inside(hang)

    def stopped_inside(self, hang: Verdict) -> bool:
        """Nobody is to blame (every member issued the collective: its ranks all wait in it, or
        went past it), and one of them recorded a stop request in that step, with no fault of its
        own before: the group was whole when the stop came (a member past it holds every peer's
        part), and the members blocked in C++ could record nothing before they were killed. A
        death in a collective leaves no such record: its peers see a closed connection (a fault)
        first, or are killed with it, or wait for it in their next collective."""
        ends = [self.facts.ends.get(rank) for rank in hang.ranks]
        if self.waiting(hang) or not all(end is not None and end.in_collective and end.step == hang.step
                                         for end in ends):
            return False
        # A member past it that waits in a later collective of the step is in `waiting` (above):
        # whoever it waits for there may be dead, so its stop says nothing of the group.
        return any(self.left_on_request(rank) and self.own[rank].step == hang.step
                   for rank in (*hang.ranks, *hang.past))


def settle_stops(verdicts: list[Verdict], facts: RunFacts) -> tuple[list[Verdict], tuple[str, ...]]:
    """The verdicts a recorded stop request explains, taken out, and a note of what was seen."""
    if not facts.stops and not facts.origins:
        return verdicts, ()
    rule = StopRule(facts)
    if not rule.asked:
        return verdicts + _deaths_in_collectives(rule, verdicts), (_no_request_note(rule, facts),)
    faults = {(f.rank, f.step, f.detail): f for f in facts.faults}
    kept, ended, faulted = [], set(), []
    for verdict in verdicts:
        if verdict.kind == "hang" and rule.explains_hang(verdict):
            ended.update(verdict.ranks, rule.waiting(verdict))
        elif verdict.kind in END_KINDS and verdict.kind != "hang" and verdict.ranks and \
                all(map(rule.explains_end, verdict.ranks)):
            ended.update(verdict.ranks)
        elif verdict.kind == "fault" and len(verdict.ranks) == 1 and \
                (fault := faults.get((verdict.ranks[0], verdict.step, verdict.detail))) and rule.explains_fault(fault):
            faulted.append(verdict)
        else:
            kept.append(verdict)
    kept += _deaths_in_collectives(rule, kept)
    return kept, (_note(rule, facts, ended, faulted, kept),)


def _deaths_in_collectives(rule: StopRule, kept: list[Verdict]) -> list[Verdict]:
    """A rank that waits in a collective a hang verdict tells of, whose end no stop request
    explains, while its peers recorded how they stopped (a request, or vLLM's shutdown of a
    failing job), died there: said on its own, since the hang blames whoever its peers saw
    fail (e.g. the peer whose connection its death reset)."""
    named = {rank for v in kept if v.kind in END_KINDS for rank in v.ranks}
    deaths = []
    for hang in [v for v in kept if v.kind == "hang"]:
        for rank in rule.waiting(hang):
            if rank not in named and not rule.explains_end(rank):
                named.add(rank)
                end = rule.facts.ends[rank]
                deaths.append(Verdict("unfinished", end.replica, end.step, (
                    f"the log ends inside a collective at step {end.step} with no stop request recorded before"
                    " it, while its peers went on to record how they stopped: the process died there"), (rank,)))
    return deaths


def _note(rule: StopRule, facts: RunFacts, ended: set[int], faulted: list[Verdict], kept: list[Verdict]) -> str:
    parts = []
    if rule.requests:
        first = _first(rule.requests)
        parts.append(f"{first.text()}, the first of {len(rule.requests)} stop request(s), by rank(s) {_ids(rule.own)}")
    parts += [f"{o.text()}, recorded there before any rank was stopped, with rank(s) {_ids(o.alive) or 'none'}"
              " alive then" for o in rule.origins]
    note = "stop requested: " + "; and ".join(parts)
    if ended:
        note += f"; rank(s) {_ids(ended)} ended after it without logging shutdown (not a finding)"
    if faulted:
        note += "; faults logged after it, its consequence: " + "; ".join(
            f"rank {v.ranks[0]} at step {v.step}: {v.detail}" for v in faulted)
    unexplained = sorted({r for v in kept if v.kind in END_KINDS for r in v.ranks if not rule.explains_end(r)})
    if unexplained:
        note += f"; rank(s) {_ids(unexplained)} ended before any stop request was recorded: a death, not a stop"
    return note


def _no_request_note(rule: StopRule, facts: RunFacts) -> str:
    if not facts.stops:
        return (f"stop request(s) recorded at their origin ({facts.origins[0].text()}) all follow a fault on its"
                " host: the job was ending on a failure, not on a stop request, and they explain nothing")
    first = _first(facts.stops)
    unasked = [s for s in facts.stops if not rule._asked(s)]
    if len(unasked) == len(facts.stops):
        return (f"stop record(s) ({first.text()}, the first of {len(facts.stops)}) are SIGTERMs no front recorded a"
                " request for: vLLM's teardown of its workers, not a stop someone asked for; they explain nothing")
    return (f"stop record(s) ({first.text()}, the first of {len(facts.stops)}) all follow a fault"
            + (" or are SIGTERMs no front recorded a request for" if unasked else "")
            + ": the job was ending on a failure, not on a stop request, and they explain nothing")


def _first(stops: list[StopSeen]) -> StopSeen:
    # steps count alike on every host, clocks only within one: the earliest step, then time
    return min(stops, key=lambda s: (s.step if isinstance(s.step, int) else -1, s.t_ns, s.rank))


def _ids(ranks) -> str:
    return ", ".join(map(str, sorted(ranks)))
