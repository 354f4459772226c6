"""Which vLLM steps prefill: the kind of step (`prefill` or `decode`) the worker's state machine
takes for a scheduler output.

A step prefills when any request it schedules has prompt tokens left to compute: a new request
whose prompt is not all computed (prefix caching may have computed some), a resumed one (it
recomputes its prompt), or one whose prompt is being computed in chunks. vLLM's scheduler output
says how many tokens each cached request has computed, not its prompt's length, so the lengths
are kept from when each request was new, until it finishes.
"""

from __future__ import annotations

from typing import Any


class StepKinds:
    def __init__(self) -> None:
        self._prompt_lens: dict[str, int] = {}  # every scheduled request's prompt length
        self._prefilling: dict[str, int] = {}  # those whose prompt may not be all computed yet

    def of(self, so: Any) -> str:
        """`prefill` when any request `so` schedules has prompt tokens left to compute, else
        `decode`. A request is looked at again only while it may still have some (new with its
        prompt not all computed, or resumed): a decode step, most of a run, costs a few empty
        checks, not a loop over the batch (this runs right after vLLM's scheduler, cold)."""
        lens, pending, prefill = self._prompt_lens, self._prefilling, False
        for new in so.scheduled_new_reqs:
            ids = new.prompt_token_ids
            length = len(ids) if ids is not None else int(new.prompt_embeds.shape[0])
            lens[new.req_id] = length
            if new.num_computed_tokens < length:
                prefill = True
                pending[new.req_id] = length
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        if resumed:  # a resumed request recomputes its prompt
            for rid in cached.req_ids:
                if rid in resumed:
                    prefill = True
                    pending[rid] = lens.get(rid, 0)
        if pending:  # plain loops, not map/any: cheaper cold (docs/vllm.md)
            get = pending.get
            for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
                length = get(rid)
                if length is not None:
                    if computed < length:
                        prefill = True
                    else:  # its prompt is computed: it decodes from now on
                        del pending[rid]
        if so.finished_req_ids:
            self.forget(so)
        return "prefill" if prefill else "decode"

    def forget(self, so: Any) -> None:
        """The requests `so` says finished are gone."""
        for rid in so.finished_req_ids:
            self._prompt_lens.pop(rid, None)
            self._prefilling.pop(rid, None)
