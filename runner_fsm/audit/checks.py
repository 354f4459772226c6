"""The rules a step must obey, each written once: the runner applies them online (and stops),
`runner-fsm replay` applies them offline to what the ranks logged (and names the culprit).

Every rule is a pure function over plain values, so the two callers only differ in where the
values come from: live objects online, the records of DESIGN section 7 offline. No torch here:
a replay must not pay for importing it.

Buffer fingerprints are tuples `(ptr, shape, version, digest)` (`BufferFingerprint` is one);
`digest` is a hash of the buffer's bytes, or None where the writer logged none.
"""

from __future__ import annotations

import zlib
from typing import Mapping, Sequence

_PTR, _SHAPE, _VERSION, _DIGEST = range(4)

# ---------------------------------------------------------------- stale inputs (stale_buffer_replay)


def moved_storage(captured: Mapping[str, Sequence], now: Mapping[str, Sequence]) -> list[str]:
    """Buffers whose storage (address, shape) differs from capture: a graph would read elsewhere."""
    return [name for name, then in captured.items()
            if name in now and (now[name][_PTR] != then[_PTR] or list(now[name][_SHAPE]) != list(then[_SHAPE]))]


def stale_inputs(now: Mapping[str, Sequence], since: Mapping[str, Sequence] | None,
                 last_real: Mapping[str, Sequence] | None) -> str | None:
    """Why a forward (eager or graph) on inputs `now` would read stale data, or None.

    `since`: the fingerprint when the step began (or the previous step's last snapshot);
    a buffer whose write count did not move was not written for this step.
    `last_real`: the inputs of the last real batch; inputs whose bytes all equal those were
    not refreshed, whatever the counters say (`buf.copy_(buf)` moves the counter, not the data).
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


# ---------------------------------------------------------------- the PCP context (stale_context)


def context_problem(step: int, batch: Mapping, ctx: Mapping) -> str | None:
    """Why the PCP attention context `ctx` does not belong to the step's batch, or None.

    Both are identities `{"step", "dummy", "rows"}`: the step a context (batch) was built for,
    whether it is a dummy and its rows per rank. A forward must use the context built for its
    own batch, in its own step: a dummy on a saved real context is the hand-off bug.
    """
    if ctx["step"] == batch["step"] and bool(ctx["dummy"]) == bool(batch["dummy"]) \
            and ctx["rows"] == batch["rows"]:
        return None
    kind = "dummy" if batch["dummy"] else "real"
    got = "a dummy" if ctx["dummy"] else "a real batch's"
    return (f"the {kind} forward of step {step} ({batch['rows']} rows) used {got} PCP context"
            f" built at step {ctx['step']} for {ctx['rows']} rows")


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


def dispatch_inputs(num_scheduled, is_prefilling, pcp_size: int, chunking: str) -> dict:
    """What determines the PCP-local dispatch count, compactly: decode tokens in one sum (they
    are replicated on every PCP rank), each prefill's length (prefills are few)."""
    import numpy as np  # the runner has it loaded already; a replay never calls this

    scheduled = np.asarray(num_scheduled)
    prefilling = np.asarray(is_prefilling, dtype=bool)
    return {"decode": int(scheduled[~prefilling].sum()), "prefill": scheduled[prefilling].tolist(),
            "pcp": int(pcp_size), "chunking": chunking}


def recomputed_dispatch_count(inputs: Mapping) -> int:
    """The dispatch count N the logged `inputs` yield (`pcp.plan.num_tokens_for_dispatch`)."""
    from runner_fsm.pcp.plan import num_tokens_for_dispatch  # numpy only, loaded on first use

    decode, prefills = int(inputs["decode"]), list(inputs["prefill"])
    lengths = ([decode] if decode else []) + prefills
    flags = ([False] if decode else []) + [True] * len(prefills)
    if not lengths:
        return 0
    return num_tokens_for_dispatch(lengths, flags, int(inputs["pcp"]), chunking=inputs["chunking"])


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
    crc, count = 0, 0
    for request, tokens in sampled.items():
        crc = zlib.crc32(request.encode(), crc)
        crc = zlib.crc32(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens), crc)
        count += len(tokens)
    return crc, count


def divergent_outputs(digests: Mapping[int, int]) -> dict[int, int] | None:
    """{pcp_rank: digest} when the PCP ranks of one replica sampled different tokens, else None."""
    return dict(digests) if len(set(digests.values())) > 1 else None
