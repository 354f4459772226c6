"""Which replica is out of order in one DP agreement: the rule the online check (`dp.agree`)
and `runner-fsm replay` both apply, written once here.

Every member of the agreement sent its own key `(step, phase[, sequence])` to the same
collective (gloo matches collectives by position), so when the keys differ some replica
skipped or repeated a collective. Who:

0. when the job's last phase of a step is known (`last_phase`: TARGET without a drafter,
   DRAFT_PREFILL when K = 1, DRAFT_DECODE when K > 1, K being the same on every replica), a
   replica whose key has a later phase is out of order by itself: it ran a draft pass no step
   of this job has (an extra draft step, vllm-ascend #12036), in the step its key names;
1. a strict majority sent one key: the others are out of order (skipped or repeated);
2. otherwise, when the members split into exactly two keys that can be ordered (with two
   replicas a majority cannot decide), the side AHEAD in (step, phase, sequence) order is out
   of order: it ran past a collective its peers are still in (a skip is likelier than an
   invented collective; the same bet `sequences` makes offline);
3. otherwise it is a tie (three or more keys without a majority, or keys that cannot be
   ordered, e.g. a phase outside TARGET < DRAFT_PREFILL < DRAFT_DECODE): reported as such,
   never guessed.

The step named is the step in which the culprit went wrong: the majority's step, or the step
of the side behind (the collective the side ahead skipped belongs to it). Pure, no torch:
`dp` and the replay both import it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

# dp.TARGET, dp.DRAFT_PREFILL, dp.DRAFT_DECODE, in the order a step runs them (`dp` checks
# that its numbers agree with this).
PHASE_ORDER = {1: 0, 2: 1, 3: 2}
PHASE_NAMES = {1: "TARGET", 2: "DRAFT_PREFILL", 3: "DRAFT_DECODE"}

def last_phase(num_speculative_tokens: int) -> int:
    """The last phase of a step with K draft tokens: TARGET without a drafter, DRAFT_PREFILL when
    K = 1, DRAFT_DECODE when K > 1 (one agreement for the K - 1 draft decode passes)."""
    return 1 if num_speculative_tokens <= 0 else 2 if num_speculative_tokens == 1 else 3


MAJORITY, AHEAD, BEYOND, TIE = "majority", "ahead", "beyond", "tie"


@dataclasses.dataclass(frozen=True)
class OutOfOrder:
    """The verdict of the rule over one agreement's keys; identical wherever it is computed."""

    culprits: tuple[int, ...]  # replicas out of order; empty on a tie
    step: int | None  # the step the culprits went wrong in; None on a tie
    basis: str  # BEYOND | MAJORITY | AHEAD | TIE
    expected: tuple | None  # the key the culprits should have sent; None on a tie or BEYOND
    sent: tuple[tuple[int, tuple], ...]  # (replica, key) of every member, by replica

    @property
    def tie(self) -> bool:
        return self.basis == TIE

    def describe(self) -> str:
        """One sentence: 'culprit: replica 0 at step 5 (...)', or the tie and why."""
        if self.tie:
            return ("no culprit: a tie that neither a majority nor the (step, phase, sequence) order"
                    f" can break ({_each(self.sent)})")
        who = ", ".join(map(str, self.culprits))
        noun = "replica" if len(self.culprits) == 1 else "replicas"
        if self.basis == BEYOND:
            sent = dict(self.sent)[self.culprits[0]]
            return (f"culprit: {noun} {who} at step {self.step} (it sent {key_text(sent)}, a phase later than"
                    " the last of any step of this job: a draft pass its peers do not run), odd one(s) out:"
                    f" replica(s) {who}")
        if self.basis == MAJORITY:
            why = "the others sent the majority's key"
        else:
            why = ("no majority; it is ahead in (step, phase, sequence) order: it skipped a collective"
                   " its peers are still in")
        return (f"culprit: {noun} {who} at step {self.step} ({why}); expected {key_text(self.expected)},"
                f" odd one(s) out: replica(s) {who}")


def key_text(key: Sequence) -> str:
    """'step 5 DRAFT_PREFILL' or 'step 5 DRAFT_PREFILL seq 12'."""
    text = f"step {key[0]} {PHASE_NAMES.get(key[1], f'phase {key[1]}')}"
    return text + (f" seq {key[2]}" if len(key) > 2 else "")


def _each(sent) -> str:
    return ", ".join(f"replica {replica} sent {key_text(key)}" for replica, key in sent)


def _order(key: tuple) -> tuple | None:
    """The key as a sortable tuple, or None when it cannot be placed in the order."""
    if len(key) < 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in key):
        return None
    rank = PHASE_ORDER.get(key[1])
    return None if rank is None else (key[0], rank, *key[2:])


def out_of_order(sent: Mapping[int, Sequence[int]], *, last_phase: int | None = None) -> OutOfOrder | None:
    """The replicas out of order among `sent` (replica -> (step, phase[, sequence])), or None
    when every replica sent the same key. `last_phase`: the last phase a step of this job has,
    when known (rule 0)."""
    keyed = tuple(sorted((replica, tuple(key)) for replica, key in sent.items()))
    if not keyed:
        raise ValueError("out_of_order needs the key of at least one replica")
    counts = collections.Counter(key for _, key in keyed)
    if len(counts) == 1:
        return None
    beyond = _beyond(keyed, last_phase)
    if beyond is not None:
        return beyond
    top, n = counts.most_common(1)[0]
    if n * 2 > len(keyed):
        odd = tuple(replica for replica, key in keyed if key != top)
        return OutOfOrder(odd, top[0], MAJORITY, top, keyed)
    ordered = {key: _order(key) for key in counts}
    if len(counts) == 2 and None not in ordered.values():
        behind, ahead = sorted(counts, key=ordered.__getitem__)
        odd = tuple(replica for replica, key in keyed if key == ahead)
        return OutOfOrder(odd, behind[0], AHEAD, behind, keyed)
    return OutOfOrder((), None, TIE, None, keyed)


def past_last_phase(phase, last_phase: int | None) -> bool:
    """Whether `phase` comes after `last_phase` (rule 0's test; False when either is unknown)."""
    return last_phase in PHASE_ORDER and phase in PHASE_ORDER and PHASE_ORDER[phase] > PHASE_ORDER[last_phase]


def _beyond(keyed: tuple[tuple[int, tuple], ...], last_phase: int | None) -> OutOfOrder | None:
    """Rule 0: the replicas whose phase comes after `last_phase`, when some (not all) do and
    they agree on one key."""
    odd = {replica: key for replica, key in keyed if len(key) > 1 and past_last_phase(key[1], last_phase)}
    if not odd or len(odd) == len(keyed) or len(set(odd.values())) != 1:
        return None
    key = next(iter(odd.values()))
    return OutOfOrder(tuple(sorted(odd)), key[0], BEYOND, None, keyed)
