"""vLLM's `SchedulerOutput` to the runner's `ScheduledBatch`, and the per-request state behind it.

vLLM sends each request's prompt once (`scheduled_new_reqs`) and then only differences
(`scheduled_cached_reqs`): the scheduler's `num_computed_tokens`, newly allocated block ids
(appended, or replacing the whole table when the request resumes after preemption) and its
count of output tokens. The worker keeps what it sampled, so a request's known tokens are its
prompt then its outputs, and a step schedules `tokens[c : c + n - k]` followed by the `k`
draft tokens vLLM sends for verification.

A request with more than one known token still to compute is prefilling (a prompt chunk or a
recompute after preemption); its sample is kept only when the chunk reaches its last known
token. vLLM's block ids are the runner's paged-KV blocks: one KV cache group, used as is.

Duck-typed on vLLM's dataclasses (no vLLM import), so it is testable without vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from runner_fsm.batch import ScheduledBatch
from runner_fsm.integrations.vllm.errors import RequestStateError

PAD_BLOCK = -1  # table padding: never another request's block; the drafter stops at it


@dataclasses.dataclass
class RequestState:
    """What the worker knows of one live request."""

    req_id: str
    tokens: list[int]  # prompt then sampled outputs
    prompt_len: int
    block_ids: list[int]
    num_computed: int = 0

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One real step: the batch in vLLM's request order, and whose samples are kept."""

    batch: ScheduledBatch
    emits: tuple[bool, ...]  # per request: the step completes its known tokens


class RequestTable:
    """Per-request state of one worker, updated from each `SchedulerOutput`."""

    def __init__(self, *, drafting: bool, admit: Callable[[Any], None] = lambda _req: None):
        self.requests: dict[str, RequestState] = {}
        self.drafting = drafting
        self._admit = admit
        self._finished: list[str] = []  # finished since the last real batch (told to the replica)
        self._prefix_hits: set[str] = set()  # new since the last real batch, with cached tokens
        self.num_resumed = 0  # requests vLLM resumed after preempting them
        self.num_prefix_hits = 0  # new requests whose first tokens vLLM found in the prefix cache

    def __len__(self) -> int:
        return len(self.requests)

    # -- state updates ------------------------------------------------------------------

    def update(self, so: Any) -> None:
        """Apply finished, new and cached requests of scheduler output `so`, in vLLM's order."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._finished.append(rid)
        for new in so.scheduled_new_reqs:
            self._admit(new)
            prompt = list(new.prompt_token_ids)
            if new.num_computed_tokens > 0:  # its first blocks were filled by other requests
                self.num_prefix_hits += 1
                self._prefix_hits.add(new.req_id)
            self.requests[new.req_id] = RequestState(
                new.req_id, prompt, len(prompt), _one_group(new.block_ids, new.req_id),
                int(new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            state = self._get(rid, "a cached request")
            state.num_computed = int(cached.num_computed_tokens[i])
            new_blocks = cached.new_block_ids[i]
            if rid in resumed:
                if new_blocks is None:
                    raise RequestStateError(f"request {rid!r} resumed without a block table")
                state.block_ids = _one_group(new_blocks, rid)
                self.num_resumed += 1
            elif new_blocks is not None:
                state.block_ids.extend(_one_group(new_blocks, rid))
            outputs = int(cached.num_output_tokens[i])
            if outputs < state.num_outputs:  # the scheduler dropped outputs: follow it
                del state.tokens[state.prompt_len + outputs:]

    def _get(self, rid: str, what: str) -> RequestState:
        state = self.requests.get(rid)
        if state is None:
            raise RequestStateError(f"vLLM scheduled {what} {rid!r} that this worker never saw"
                                    f" as a new request (known: {sorted(self.requests)[:8]})")
        return state

    # -- batches ------------------------------------------------------------------------

    def plan(self, so: Any) -> StepPlan:
        """The step's batch, requests in the order of `so.num_scheduled_tokens`."""
        spec = so.scheduled_spec_decode_tokens or {}
        req_ids, scheduled, prefilling, computed, emits, ids, tables, drafts = ([] for _ in range(8))
        for rid, n in so.num_scheduled_tokens.items():
            state = self._get(rid, "request")
            k_tokens = [int(t) for t in spec.get(rid, ())]
            if any(t < 0 for t in k_tokens):
                raise RequestStateError(f"request {rid!r}: draft tokens {k_tokens} hold a placeholder"
                                        f" id; structured-output drafts are not supported")
            known = int(n) - len(k_tokens)
            start, remaining = state.num_computed, len(state.tokens) - state.num_computed
            if known < 1 or known > remaining:
                raise RequestStateError(
                    f"request {rid!r}: vLLM schedules {n} tokens ({len(k_tokens)} drafts) from"
                    f" position {start}, but the worker knows {len(state.tokens)} tokens")
            req_ids.append(rid)
            scheduled.append(int(n))
            prefilling.append(remaining > 1)
            computed.append(start)
            emits.append(known == remaining)
            ids.extend(state.tokens[start:start + known] + k_tokens)
            tables.append(state.block_ids)
            drafts.append(len(k_tokens))
        width = max(len(t) for t in tables)
        padded = [t + [PAD_BLOCK] * (width - len(t)) for t in tables]
        # A finished id scheduled again (abort, then the same id resubmitted) is a new request.
        finished = [rid for rid in dict.fromkeys(self._finished) if rid not in so.num_scheduled_tokens]
        adopted = [rid for rid in req_ids if rid in self._prefix_hits]
        self._finished, self._prefix_hits = [], set()
        batch = ScheduledBatch.build(req_ids, scheduled, prefilling, computed, ids, padded,
                                     num_draft_tokens=drafts if self.drafting else None,
                                     finished_req_ids=finished, cached_prefix_req_ids=adopted)
        return StepPlan(batch, tuple(emits))

    def commit(self, plan: StepPlan, sampled: dict[str, list[int]]) -> list[list[int]]:
        """Append the kept samples; per request of the plan, the tokens vLLM gets back."""
        out = []
        for rid, emits in zip(plan.batch.req_ids, plan.emits):
            tokens = [int(t) for t in sampled.get(rid, ())] if emits else []
            if emits and not tokens:
                raise RequestStateError(f"request {rid!r}: the step sampled no token for it")
            self.requests[rid].tokens.extend(tokens)
            out.append(tokens)
        return out


def _one_group(block_ids: Any, rid: str) -> list[int]:
    """vLLM's per-group block ids; the runner's model has one KV cache group."""
    groups = list(block_ids)
    if len(groups) != 1:
        raise RequestStateError(f"request {rid!r} has block ids for {len(groups)} KV cache groups;"
                                f" the runner's model has one (full attention, every layer)")
    return [int(b) for b in groups[0]]

