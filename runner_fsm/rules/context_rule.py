"""The PCP context rule (`stale_context`), written once: the runner applies it inside every
target forward (and stops), `runner-fsm replay` to the forward's record (and names the culprit).

A forward's record carries two identities `{"step", "dummy", "rows", "digest"}`
(`evidence.identity`): `ctx`, what the PCP attention context it used says it was built for
(its own `built_for_step` and the digest of its own arrays), and `batch`, what the step runs
(the digest taken from the step's own plan or dummy). Replay recomputes the verdict from the
pair, never from a record of the runner's own check. A forward without a complete pair cannot
be judged, and replay says so (a `gap`) rather than read it as sound; a writer that puts the
identities on none of its forwards is not judged for `stale_context`: the vLLM worker logs them
where a PCP context exists to identify (Model Runner V2's PCP manager, DP > 1 and PCP > 1,
`integrations.vllm.pcp_evidence`), not on Model Runner V1 nor without PCP.
Pure, no torch.
"""

from __future__ import annotations

from typing import Mapping

CONTEXT_FIELDS = ("step", "dummy", "rows", "digest")


def context_evidence_missing(batch, ctx) -> str | None:
    """What a forward's record lacks to judge its PCP context, or None when it is complete."""
    for name, value in (("ctx", ctx), ("batch", batch)):
        if not isinstance(value, Mapping):
            return f"no `{name}` identity"
        absent = [f for f in CONTEXT_FIELDS if f not in value]
        if absent:
            return f"its `{name}` identity lacks {', '.join(absent)}"
    return None


def context_problem(step: int, batch: Mapping, ctx: Mapping) -> str | None:
    """Why the PCP attention context `ctx` does not belong to the step's batch, or None: a
    forward must use the context built for its own batch, in its own step, holding its plan's
    arrays (a dummy on a saved real context is the hand-off bug)."""
    if ctx["step"] == batch["step"] and bool(ctx["dummy"]) == bool(batch["dummy"]) \
            and ctx["rows"] == batch["rows"] and ctx.get("digest") == batch.get("digest"):
        return None
    kind = "dummy" if batch["dummy"] else "real"
    got = "a dummy" if ctx["dummy"] else "a real batch's"
    problem = (f"the {kind} forward of step {step} ({batch['rows']} rows) used {got} PCP context"
               f" built at step {ctx['step']} for {ctx['rows']} rows")
    if ctx.get("digest") != batch.get("digest"):
        # not quoted: digests differ per PCP rank, and the finding must read the same on each
        problem += f" (its arrays are not the step's {'dummy' if batch['dummy'] else 'plan'}'s: digests differ)"
    return problem


class ContextEvidence:
    """One rank's target forwards, judged as its log is read."""

    def __init__(self) -> None:
        self.logs_contexts = False  # this writer puts the identities on its forwards

    def forward(self, step: int, ctx, batch) -> tuple[str, str] | None:
        """(verdict kind, detail) of a forward's record, or None when it is sound or unjudged."""
        if ctx is None and batch is None and not self.logs_contexts:
            return None
        self.logs_contexts = True
        missing = context_evidence_missing(batch, ctx)
        if missing is not None:  # no evidence is no proof: unjudged, and said so
            return "gap", (f"the target forward of step {step} logged {missing}: whether it used the"
                           " PCP context built for its batch (stale_context) cannot be judged")
        problem = context_problem(step, batch, ctx)
        return None if problem is None else ("stale_context", problem)
