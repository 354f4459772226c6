"""A replica's step decisions and the one small integer each rank logs of them (DESIGN section 11).

Every rank of a replica (its TP and PCP peers) must take the same decisions each step: real
batch or dummy, which batch, the rows it needs (the PCP-local dispatch count) and the rows it
ran (padded), graph replay (its size) or eager, how many drafter forwards ran, and what it
sampled. A rank that decides otherwise deadlocks its peers' collectives or silently slows
them (SGLang #31566: idle ranks took another capture mode; vLLM #49027: the drafter gate
diverged across TP ranks).

Each rank logs, on its step's `finish` transition, `decision_digest` (a 32-bit hash of every
decision, sampled tokens included: about 15 bytes a step, compact key `dg`) and `decisions`: those of
`FIELDS` that changed since its previous step (all of them on its first; compact key `dc`). The
sampled tokens change every step, so only the digest holds them. Replay rebuilds each rank's
decisions from those changes and compares digests (`rules.consensus`); the decisions say which
one differs. The same digests are what the online check exchanges.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import orjson

FIELDS = ("real", "batch", "dispatch", "padded", "graph", "draft")  # in `decisions`, in this order
# What every pipeline stage of a replica decides alike; the drafter and the sampler run on the
# last stage only, and each stage's rows are its own.
PP_SHARED = ("real", "batch", "padded", "graph")
TOKENS = "sampled tokens"  # the decision only the digest holds
DIGEST_FIELD, DECISIONS_FIELD = "decision_digest", "decisions"  # on a `finish` transition record
# The drafter's gate: a record written the moment a rank decides whether its drafter runs this
# step, before any of the drafter's collectives (`{"event": "gate", "draft": steps}`, 0: it does
# not run). Where ranks' gates disagree, the one that drafts waits in a collective its peer never
# joins (vLLM #49027): no `finish` of that step ever carries its digest, the gate record does.
GATE_EVENT, GATE_FIELD = "gate", "draft"
# The digests of plain ints are Python's tuple hash, kept to 32 bits: the same in every process
# and on every 64-bit CPython since 3.8 (PYTHONHASHSEED salts str and bytes, never an int or a
# tuple of ints), so every rank of a job computes the same one. They run at each vLLM step's
# end, right after vLLM's sampler evicted the CPU caches, where `hash` (the interpreter's own
# code, warm from vLLM's dict lookups) costs about a microsecond and a first call into struct,
# zlib or orjson 7-18 us. Request ids are strings, salted: what holds them goes through crc32.
DIGEST_MASK = 0xFFFFFFFF


class StepDecisions(NamedTuple):
    """One rank's decisions in one step; identical on every TP and PCP rank of its replica.

    A NamedTuple rather than a frozen dataclass: one is built every embedded step, and a frozen
    dataclass's `__init__` (one `object.__setattr__` per field) cost several times as much."""

    real: bool  # a real batch (False: a dummy)
    batch: int  # `batch_identity` of the scheduled batch; 0 for a dummy
    dispatch: int  # rows the batch needs per rank (the PCP-local dispatch count); 0 for a dummy
    padded: int  # rows it ran after the DP agreement (0: every replica was idle, no forward)
    graph: int  # the graph size it replayed; 0: eager
    draft: int  # drafter forwards it ran this step (0: the drafter did not run)
    tokens: int = 0  # `tokens_digest` of what it sampled (0: nothing)

    def digest(self) -> int:
        """A 32-bit hash of every decision, the sampled tokens included (`decisions_digest`)."""
        return decisions_digest(self.real, self.batch, self.dispatch, self.padded, self.graph, self.draft, self.tokens)

    def fields(self) -> dict[str, int]:
        """The decisions `FIELDS` names (the sampled tokens are the digest's only)."""
        return {"real": int(self.real), "batch": self.batch, "dispatch": self.dispatch, "padded": self.padded,
                "graph": self.graph, "draft": self.draft}


def decisions_digest(real: bool, batch: int, dispatch: int, padded: int, graph: int, draft: int, tokens: int) -> int:
    """`StepDecisions.digest` of the decisions as plain values (a hot loop builds no object)."""
    return digest_of((real, batch, dispatch, padded, graph, draft, tokens))


def digest_of(decided: tuple) -> int:
    """The digest of (real, batch, dispatch, padded, graph, draft, tokens), as one tuple: its
    hash (`real` a bool or 0/1: True and 1 hash alike), 32 bits."""
    return hash(decided) & DIGEST_MASK


def batch_identity(req_ids: Sequence[str], num_scheduled: Sequence[int]) -> int:
    """crc32 of the batch's requests and the tokens scheduled for each: what its ranks were
    all handed. The tokens already computed are left out, so a run of decode steps keeps one
    identity and `decisions` need not repeat it."""
    if getattr(num_scheduled, "ndim", None) == 1 and num_scheduled.dtype.kind in "iu":
        # a numpy array of ints (the embedded engine's): the same ints by `tolist`, where one
        # numpy scalar and one int() per request cost ~7 us an embedded step
        return zlib.crc32(orjson.dumps([list(req_ids), num_scheduled.tolist()]))
    return zlib.crc32(orjson.dumps([list(req_ids), [int(n) for n in num_scheduled]]))


def tokens_digest(sampled: Mapping[str, Sequence[int]] | Sequence[Sequence[int]]) -> int:
    """A 32-bit digest of the sampled tokens per request, in the batch's order (0: nothing
    sampled). vLLM's list of token lists (one per request, by position): the hash of them as
    tuples (numpy integers hash as the ints they hold); keyed by request id (the embedded
    engine's dict): crc32 of its JSON, since a str's hash differs between processes."""
    if not sampled:
        return 0
    if type(sampled) is list:
        return hash(tuple(map(tuple, sampled))) & DIGEST_MASK
    return zlib.crc32(orjson.dumps(sampled, option=orjson.OPT_SERIALIZE_NUMPY))


def decide(values: tuple, sampled: Sequence[Sequence[int]] | Mapping | None, last: tuple | None
           ) -> tuple[int, int, bytes | None]:
    """One step's (tokens digest, decision digest, `finish` tail): `values` its `FIELDS` values
    as ints, `sampled` what it sampled (`tokens_digest`), `last` the values of the step before.
    The tail is the rendered `dg` where no decision changed (most of a decode run); None where
    one did, for `compact.decisions_tail` to render the changes too."""
    tokens = tokens_digest(sampled) if sampled else 0
    digest = digest_of((*values, tokens))
    return tokens, digest, (b',"dg":%d' % digest if values == last else None)


class DecisionChanges:
    """Which decisions changed since the last step, for a writer that holds them as a tuple of
    `FIELDS` values (ints), by position as the compact `dc` writes it (`compact`); `DecisionLog`
    gives the same by name. An unchanged step, most of a decode run, costs one comparison."""

    def __init__(self) -> None:
        self._last: tuple[int, ...] | None = None

    def changed(self, values: tuple[int, ...]) -> list[int | None] | None:
        """`values` where they changed since the last call (`changed_since`)."""
        last, self._last = self._last, values
        return changed_since(last, values)


def changed_since(last: tuple[int, ...] | None, values: tuple[int, ...]) -> list[int | None] | None:
    """`values` where they differ from `last`, None where not, the trailing Nones left out (all
    of them where there is no `last`; None when nothing changed): for a writer that keeps the
    last values itself (the vLLM recorder) or through `DecisionChanges`."""
    if last is None:
        return list(values)
    if values == last:
        return None
    changed = [value if value != before else None for value, before in zip(values, last)]
    while changed[-1] is None:
        changed.pop()
    return changed


class DecisionLog:
    """What one rank writes of its decisions step after step: the digest, and the decisions
    that changed since the step it last wrote (by name; `DecisionChanges` decides which)."""

    def __init__(self) -> None:
        self._changes = DecisionChanges()

    def entry(self, decided: StepDecisions) -> tuple[int, dict[str, int] | None]:
        """(digest, the changed decisions or None) for this step's `finish` record."""
        # `fields()`'s values without its dict, and `digest()`'s tuple hash from them: each
        # embedded step's end, where the dict and the calls in between cost ~2 us
        values = (int(decided.real), decided.batch, decided.dispatch, decided.padded, decided.graph, decided.draft)
        digest = digest_of((*values, decided.tokens))  # `real` as 0/1: True and 1 hash alike
        changed = self._changes.changed(values)
        if changed is None:
            return digest, None
        return digest, {name: value for name, value in zip(FIELDS, changed) if value is not None}


def outvoted(digests: Mapping[int, int]) -> tuple[int, int | None, bool]:
    """The rule online and offline alike, over {rank: digest} of one group of peers: (the
    reference rank, the first rank whose digest differs from it or None, whether a strict
    majority logged the reference's digest). The reference is the majority's lowest rank, else
    (no strict majority: with two ranks a mismatch says that they differ, not which one is
    wrong) the lowest rank."""
    counts: dict[int, int] = {}
    for digest in digests.values():
        counts[digest] = counts.get(digest, 0) + 1
    top = max(counts, key=counts.__getitem__)
    majority = counts[top] * 2 > len(digests)
    digest = top if majority else digests[min(digests)]
    reference = min(rank for rank, d in digests.items() if d == digest)
    odd = min((rank for rank, d in digests.items() if d != digest), default=None)
    return reference, odd, majority


def first_difference(mine: Mapping | None, theirs: Mapping | None, names=FIELDS, *, known_only=False):
    """(name, mine, theirs) of the first of `names` whose decisions differ; (TOKENS, None, None)
    when all are known and equal (then the digests differ in the sampled tokens); (None, None,
    None) when some are unknown. `known_only`: None when none of the known ones differ."""
    mine, theirs = mine or {}, theirs or {}
    unknown = False
    for name in names:
        if name not in mine or name not in theirs:
            unknown = True
        elif mine[name] != theirs[name]:
            return name, mine[name], theirs[name]
    if known_only:
        return None
    return (None, None, None) if unknown else (TOKENS, None, None)


class DecisionTrail:
    """One rank's decisions as replay reads them back (`scan`): the changes each `finish`
    logs, applied in order; after a jump in the log (a seek, segments rotated away) they are
    unknown until they are logged again."""

    def __init__(self) -> None:
        self.known: dict | None = None

    def finish(self, step, record: Mapping) -> None:
        """`step` (the scanner's `read.StepBuilder`) takes the digest of its `finish` `record`
        and the decisions known then."""
        changed, known = record.get(DECISIONS_FIELD), None if step.resumed else self.known
        if isinstance(changed, dict):  # a new object: the steps sealed before keep theirs
            known = {**(known or {}), **changed}
        self.known = known
        step.digest, step.decisions = record[DIGEST_FIELD], known
