"""The rules a step must obey, each written once: the runner applies them online (and stops),
`runner-fsm replay` applies them offline to what the ranks logged (and names the culprit).

Every rule is a pure function over plain values, so the two callers only differ in where the
values come from: live objects online, the records of DESIGN section 7 offline. No torch here:
a replay must not pay for importing it. Offline, the rules that need a rank's history are fed
by a tracker per rank: `BufferTracker` (stale inputs) and `TransitionChecker` (the table).

Buffer fingerprints are tuples `(ptr, shape, version, digest)` (`BufferFingerprint` is one);
`digest` is a hash of the buffer's bytes, or None where the writer logged none.

- stale inputs (`stale_buffer_replay`, eager and graph alike): the inputs of a forward (the
  step's last `buffers` snapshot) must have been written since the previous step's snapshot
  (write counts moved) and must not hold the very bytes of the last real batch (content
  digests): `buf.copy_(buf)` moves the counter, not the data. A graph replay must also read
  the storage it was captured on. Forward points are graph replays, eager target forwards, and
  (older logs) `refused` snapshots; a forward that wrote no inputs this step logs them first.
- the PCP context (`stale_context`): in `context_rule`, the identity a forward's context
  carries against its batch's (from the step's plan or dummy), both on the forward's record.
- the own agreement (`agreed_mismatch`): a replica's copy of an agreement is for its step and
  phase and gives it what it sent (DESIGN section 5).
- the dispatch count (`dispatch_mismatch`): recomputed from the logged batch inputs.
- step outputs (`pcp_divergence`): the PCP ranks of a replica sample the same tokens.
- transitions (`illegal_transition`): each logged transition follows from the table the
  runtime machine is built from and chains onto the previous one (`init` first): `ok` reaches
  the table's destination; `error` and `cancelled` leave the replica where it was or at the
  destination; `refused` leaves the state unchanged, and the table indeed has no such edge.
"""

from __future__ import annotations

import functools
import zlib
from typing import Mapping, Sequence

from runner_fsm.audit.expand import FINGERPRINTS
from runner_fsm.rules.transitions import OUTCOMES, TransitionChecker  # noqa: F401  (re-exported)
from runner_fsm.rules.verdicts import label

_PTR, _SHAPE, _VERSION, _DIGEST = range(4)

# ---------------------------------------------------------------- stale inputs (stale_buffer_replay)


def moved_storage(captured: Mapping[str, Sequence], now: Mapping[str, Sequence]) -> list[str]:
    """Buffers whose storage (address, shape) differs from capture: a graph would read elsewhere."""
    return [name for name, then in captured.items()
            if name in now and (now[name][_PTR] != then[_PTR] or (
                now[name][_SHAPE] != then[_SHAPE] and list(now[name][_SHAPE]) != list(then[_SHAPE])))]


def stale_inputs(now: Mapping[str, Sequence], since: Mapping[str, Sequence] | None,
                 last_real: Mapping[str, Sequence] | None) -> str | None:
    """Why a forward (eager or graph) on inputs `now` would read stale data, or None.

    `since`: the fingerprint when the step began (or the previous step's last snapshot);
    a buffer whose write count did not move was not written for this step.
    `last_real`: for a dummy forward, the inputs of the last real batch; a dummy whose bytes
    all equal those was not refreshed, whatever the counters say (`buf.copy_(buf)` moves the
    counter, not the data). None for a real forward: its own batch may repeat the last one.
    """
    if since:
        unwritten = [name for name, fp in now.items()
                     if name in since and since[name][_VERSION] == fp[_VERSION]]
        if unwritten:
            versions = [now[name][_VERSION] for name in unwritten]
            return f"buffers {unwritten} were not refreshed this step (versions {versions} unchanged)"
    if last_real and now and all(
            fp[_DIGEST] is not None and name in last_real and last_real[name][_DIGEST] == fp[_DIGEST]
            for name, fp in now.items()):
        return ("every buffer holds the bytes of the last real batch (content digests unchanged):"
                " the inputs were not refreshed")
    return None


# ---------------------------------------------------------------- the own agreement (agreed_mismatch)


def own_agreement_problem(step: int, phase: int, sent_tokens: int | None, agreed_step, agreed_phase,
                          agreed_tokens, graph_mode) -> str | None:
    """What a replica's copy of an agreement contradicts in what it sent, or None (DESIGN §5).

    The agreement is for the step and phase it was reached in, and gives the replica its own
    count in eager mode, at least that when graph mode pads every replica to one size.
    """
    if agreed_step != step or agreed_phase != phase:
        return f"agreed on step {agreed_step} phase {agreed_phase}"
    if sent_tokens is None or agreed_tokens == sent_tokens:
        return None
    padded = graph_mode == 2
    if padded and isinstance(agreed_tokens, int) and agreed_tokens >= sent_tokens:
        return None
    mode = "full graph: at least" if padded else "eager: exactly"
    return f"sent num_tokens={sent_tokens} but its copy of the agreement gives it {agreed_tokens} ({mode} what it sent)"


# ---------------------------------------------------------------- the dispatch count (dispatch_mismatch)


def dispatch_inputs(num_scheduled, is_prefilling, pcp_size: int, chunking: str, *,
                    per_decode: bool = False) -> dict:
    """What determines the PCP-local dispatch count, compactly: decode tokens in one sum (they
    are replicated on every PCP rank), each prefill's length (prefills are few). `per_decode`:
    each decode's length too (`decodes`), where decodes are sharded over the PCP ranks (vLLM
    MRV2 without DCP gives each decode one owner rank), so one sum would not yield the count."""
    import numpy as np  # the runner has it loaded already; a replay never calls this

    scheduled = np.asarray(num_scheduled)
    prefilling = np.asarray(is_prefilling, dtype=bool)
    inputs = {"decode": int(scheduled[~prefilling].sum()), "prefill": scheduled[prefilling].tolist(),
              "pcp": int(pcp_size), "chunking": chunking}
    if per_decode:
        inputs["decodes"] = scheduled[~prefilling].tolist()
    return inputs


def recomputed_dispatch_count(inputs: Mapping) -> int:
    """The dispatch count N the logged `inputs` yield (`pcp.plan.num_tokens_for_dispatch`)."""
    decodes = inputs.get("decodes")
    return _dispatch_count(int(inputs["decode"]), tuple(inputs["prefill"]), int(inputs["pcp"]), inputs["chunking"],
                           None if decodes is None else tuple(decodes))


@functools.lru_cache(maxsize=4096)  # replay meets the same batch shapes again and again
def _dispatch_count(decode: int, prefills: tuple, pcp: int, chunking: str, decodes: tuple | None = None) -> int:
    from runner_fsm.pcp.plan import num_tokens_for_dispatch  # numpy only, loaded on first use

    if decodes is None:  # replicated decodes: their sum is one request's worth on every rank
        decodes = (decode,) if decode else ()
    lengths = list(decodes) + list(prefills)
    flags = [False] * len(decodes) + [True] * len(prefills)
    if not lengths:
        return 0
    return num_tokens_for_dispatch(lengths, flags, pcp, chunking=chunking)


def dispatch_problem(inputs: Mapping, sent_tokens: int) -> str | None:
    expected = recomputed_dispatch_count(inputs)
    if expected == sent_tokens:
        return None
    return (f"sent num_tokens={sent_tokens} to the DP agreement, but its batch ({inputs['decode']} decode"
            f" tokens, prefills {inputs['prefill']}, PCP={inputs['pcp']}, {inputs['chunking']}) dispatches"
            f" {expected} tokens per PCP rank")


# ---------------------------------------------------------------- step outputs (pcp_divergence)


def output_digest(sampled: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(crc32, token count) of a step's sampled tokens, in the batch's request order."""
    import orjson  # the audit log's encoder: loaded already wherever this runs

    return zlib.crc32(orjson.dumps(sampled, option=orjson.OPT_SERIALIZE_NUMPY)), sum(map(len, sampled.values()))


def divergent_outputs(digests: Mapping[int, int]) -> dict[int, int] | None:
    """{pcp_rank: digest} when the PCP ranks of one replica sampled different tokens, else None."""
    return dict(digests) if len(set(digests.values())) > 1 else None


def _tuples(snapshot: dict) -> dict:
    """A logged snapshot {name: {ptr, shape, version, digest}} as the rule's tuples."""
    return {name: (fp["ptr"], fp["shape"], fp["version"], fp.get("digest")) for name, fp in snapshot.items()}


class BufferTracker:
    """One rank's buffer snapshots as its log is read: captures, the current step's last
    snapshot, the previous step's, and the last real batch's."""

    def __init__(self) -> None:
        self._captured: dict = {}  # graph size -> snapshot logged at its capture
        self._largest: int | None = None  # the largest int size in it (asked every step, set at a capture)
        self.captured: frozenset = frozenset()  # its int sizes (set at a capture)
        self._capture_size = None
        self.forget_steps()

    def largest_capture(self) -> int | None:
        """The largest graph size captured (None: none, or sizes not logged)."""
        return self._largest

    def forget_steps(self) -> None:
        """Drop what earlier steps left (a scan resumed mid-file); captures are kept."""
        self._previous = None  # last snapshot of an earlier step
        self._current = None  # last snapshot of the current step
        self._last_real = None  # last snapshot written for a real batch of an earlier step
        self._step_real = None  # the current step's real batch snapshot
        self._step_dummy = False  # the current step wrote a dummy: its inputs must not be the real ones
        self._last_replay = self._last_replay_step = None

    def new_step(self) -> None:
        if self._step_real is not None:
            self._last_real, self._step_real = self._step_real, None
        if self._current is not None:
            self._previous, self._current = self._current, None
        self._step_dummy = False

    def buffers(self, record, step: int) -> list[str]:
        """Problems of a `buffers` record: those taken at a forward point (a graph replay's
        inputs, a refused forward's) are the inputs of that forward, judged here."""
        snapshot = record.get(FINGERPRINTS)  # a compact record's, read as tuples (`expand`)
        if snapshot is None:
            snapshot = _tuples(record["buffers"])
        reason = record["reason"]
        problems = []
        size = record.get("graph_tokens")  # the graph's size, where the writer logs it here
        if reason == "replay":  # logged by the graph runner before it checks and replays
            reference = self._last_replay if self._last_replay_step == step else self._previous
            # The capture of this size; a writer that logs no size has one set of buffers for all.
            captured = self._captured.get(size) if size is not None else next(reversed(self._captured.values()), None)
            self._last_replay, self._last_replay_step = snapshot, step
            problems = check_replay(step, snapshot, reference, captured, self._dummy_reference())
        elif reason == "refused":
            problem = stale_inputs(snapshot, self._previous, self._dummy_reference())
            if problem:
                problems.append(f"forward at step {step} on stale inputs: {problem}")
        elif reason == "real":
            self._step_real = snapshot
        elif reason == "dummy":
            self._step_dummy = True
        elif reason == "capture":
            self._captured[size if size is not None else self._capture_size] = snapshot
            self.captured = frozenset(size for size in self._captured if isinstance(size, int))
            self._largest = max(self.captured, default=None)
        self._current = snapshot
        return problems

    def eager_forward(self, step: int) -> list[str]:
        """Problems of an eager target forward: its inputs are the step's last snapshot."""
        now = self._current
        if now is None:
            if self._previous is None:  # this writer logs no buffers at all: nothing to judge
                return []
            return [f"eager forward at step {step} has no buffers record in its step: nothing shows"
                    " its inputs were written"]
        problem = stale_inputs(now, self._previous, self._dummy_reference())
        return [f"eager forward at step {step} reads stale inputs: {problem}"] if problem else []

    def _dummy_reference(self):
        """The last real batch's inputs when this step's forward is a dummy, else None."""
        return self._last_real if self._step_dummy else None

    def graph(self, record, step: int) -> list[str]:
        """Problems of a graph record: a replay whose inputs were never logged (the inputs
        themselves are judged at their `buffers` record, logged before the replay)."""
        action = record["action"]
        if action == "capture":
            self._capture_size = record.get("num_tokens")
        elif action == "replay" and (self._current is None or self._last_replay_step != step):
            return [f"graph replay of {record.get('num_tokens')} tokens at step {step} has no buffers record"
                    " in its step: nothing shows its inputs were written"]
        return []


def check_replay(step: int, now, reference, captured, last_real=None) -> list[str]:
    """Problems of the inputs `now` of a graph replay at `step` (empty when sound)."""
    what = f"graph replay at step {step}"
    problems = []
    if captured is None:
        problems.append(f"{what}: no graph capture was logged before it, so its storage cannot be checked")
    else:
        moved = moved_storage(captured, now)
        if moved:
            problems.append(f"{what} reads storage that differs from capture: " + ", ".join(
                f"{name} ptr {captured[name][0]:#x} shape {list(captured[name][1])} -> "
                f"ptr {now[name][0]:#x} shape {list(now[name][1])}" for name in moved))
    stale = stale_inputs(now, reference, last_real)
    if stale:
        problems.append(f"{what} reads stale inputs: {stale}")
    return problems


def check_own_agreement(pending: tuple, agreed: dict, step: int, dp_rank: int) -> list[str]:
    """What one rank's logged agreement contradicts in its own records (empty when sound).

    `pending` is the collective as the scanner keeps it: (group, index, op, phase, pg_seq,
    line, sent). The rule is `checks.own_agreement_problem`, the one the runner applies online.
    """
    group, _, op, phase, _, _, sent = pending
    try:
        sent_tokens = sent["num_tokens"] if sent is not None else None
        got = agreed["num_tokens_across_dp"][dp_rank]
    except (KeyError, IndexError, TypeError):
        sent_tokens = got = None
    problem = own_agreement_problem(step, phase, sent_tokens, agreed.get("step_id"), agreed.get("phase"),
                                    got, agreed.get("graph_mode"))
    if problem is None:
        return []
    return [f"{label(group, op, phase)} logged at step {step}: replica {dp_rank} {problem}"]

