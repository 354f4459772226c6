"""`draft_sync`: the replicated draft of one step, on every replica (DESIGN section 6).

Fresh DP agreements for the draft (DRAFT_PREFILL, then DRAFT_DECODE when K > 1), never the
target's PCP-local one; the draft forwards, as the expert group's collectives, unless every
replica is idle. The drafter forwards a rank ran go into its step's decisions (`draft`).
"""

from __future__ import annotations

import dataclasses

from runner_fsm import dp
from runner_fsm.replica.components import ForwardStep


class DraftStep:
    """`Replica`'s `draft` handler (a mixin: it runs on the replica's agreement, collectives and state)."""

    async def _run_draft(self, _event) -> None:
        batch, k, drafter = self._batch, self.config.num_speculative_tokens, self.drafter
        sampled = self.output.sampled if self.output is not None else {}
        # The draft is replicated: it runs the global batch, so its counts are global too.
        rows = drafter.prefill_rows(batch, sampled) if batch is not None else 0
        reqs = batch.num_reqs if batch is not None else 0
        skip = self.fault_due("tp-skip-draft")  # injected: this rank's drafter gate alone says no (vLLM #49027)
        agreed = await self._agree(dp.LocalDispatch(self.step_id, dp.DRAFT_PREFILL, 0, rows, 0, 0, reqs))
        if not agreed.all_idle and not skip:
            step = ForwardStep(self.step_id, max(1, rows), agreed, rows, is_dummy=batch is None)
            await self.collectives.run("expert", "draft_prefill", drafter.prefill, batch, sampled, step,
                                       step_id=self.step_id, phase=dp.DRAFT_PREFILL, shapes=[(step.num_rows,)])
        if k > 1:
            agreed = await self._agree(dp.LocalDispatch(self.step_id, dp.DRAFT_DECODE, 0, reqs, 0, 0, reqs))
            if not agreed.all_idle and not skip:
                step = ForwardStep(self.step_id, max(1, reqs), agreed, reqs, is_dummy=batch is None)
                # injected draft-count-mismatch: one draft forward fewer than agreed (vLLM #26086)
                for _ in range(k - 1 - int(self.fault_due("draft-count-mismatch"))):
                    await self.collectives.run("expert", "draft_decode", drafter.decode, step,
                                               step_id=self.step_id, phase=dp.DRAFT_DECODE,
                                               shapes=[(step.num_rows,)])
        forwards = 0 if skip or agreed.all_idle else k - self.fault_due("draft-count-mismatch")
        self.decided = self.decided and self.decided._replace(draft=forwards)
        if batch is not None:
            self.output = dataclasses.replace(self.output, drafts=drafter.proposals())
