"""Scheduled drafts against proposals: what vLLM schedules for verification at step s+1 must be
what this replica's drafter proposed for that request (at step s, or its last proposal).

With synchronous scheduling (always on the CPU) the scheduler takes the drafts from
`take_draft_token_ids` and may only shorten them (the step's token budget, grammar validation),
so each scheduled list must be a prefix of the latest proposal. Placeholder drafts (`-1`, async
scheduling, filled in later) carry no ids to compare and are skipped.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from runner_fsm.errors import BatchError


class DraftMismatchError(BatchError):
    """vLLM scheduled draft tokens the drafter did not propose."""


class DraftLedger:
    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank
        self._latest: dict[str, tuple[int, tuple[int, ...]]] = {}  # req_id -> (step, proposal)
        self.checked = 0  # scheduled draft lists compared so far

    def proposed(self, step: int, req_ids: Sequence[str], drafts: Sequence[Sequence[int]]) -> None:
        for req_id, tokens in zip(req_ids, drafts):
            self._latest[req_id] = (step, tuple(int(t) for t in tokens))

    def check_scheduled(self, step: int, scheduled: Mapping[str, Sequence[int]]) -> None:
        problems = []
        for req_id, tokens in scheduled.items():
            tokens = tuple(int(t) for t in tokens)
            if not tokens or -1 in tokens:
                continue
            at, proposal = self._latest.get(req_id, (None, None))
            if proposal is None:
                problems.append(f"request {req_id!r}: {list(tokens)} scheduled, nothing proposed")
            elif tokens != proposal[: len(tokens)]:
                problems.append(f"request {req_id!r}: {list(tokens)} scheduled, {list(proposal)} proposed"
                                f" at step {at}")
            self.checked += 1
        if problems:
            raise DraftMismatchError(f"replica {self.dp_rank} step {step}: scheduled drafts are not the"
                                     f" drafter's proposals: " + "; ".join(problems))

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._latest.pop(req_id, None)
