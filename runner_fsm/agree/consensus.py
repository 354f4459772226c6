"""The online check that a replica agrees with itself (opt-in: `RunnerConfig.consensus`, the
engine's `consensus` flag, `runner-fsm run --consensus`; off by default).

Right after its step's `finish` record (which carries the step's decision digest,
`audit.decisions`), each rank of a replica exchanges [step id, digest, its decisions] with the
replica's other ranks (the embedded engine's PCP group): one exchange of a few integers, through
shared memory where they share a host (`shm_exchange`), else one gloo all_gather
(`ConsensusExchange`), logged like every collective (enqueue, done) and run under the collective
timeout, so a rank that never reaches the check is named instead of being waited on forever. Digests that
differ raise `DesyncError` naming the rank and the decision, by the rules replay applies to the
logged digests (`decisions.outvoted`, `decisions.first_difference`): the online and the offline
check cannot disagree.
"""

from __future__ import annotations

from runner_fsm.audit.decisions import FIELDS, TOKENS, StepDecisions, first_difference, outvoted


def consensus_row(step_id: int, decided: StepDecisions) -> list[int]:
    """What a rank sends: its step id, its digest, its decisions in `FIELDS` order."""
    return [step_id, decided.digest(), *decided.fields().values()]


class ConsensusExchange:
    """Every rank's row, in group order, by one all_gather of int64 over `group` (gloo, CPU).
    Its tensors are made once and filled through numpy views: making them each step cost more
    than the rule itself."""

    def __init__(self, group):
        self.group = group
        self._mine = self._parts = self._views = None

    def __call__(self, row: list[int]) -> list[list[int]]:
        import torch
        import torch.distributed as dist

        if self._mine is None or len(self._mine) != len(row):
            self._mine = torch.zeros(len(row), dtype=torch.int64)
            self._parts = [torch.zeros_like(self._mine) for _ in range(dist.get_world_size(self.group))]
            self._views = (self._mine.numpy(), [part.numpy() for part in self._parts])
        self._views[0][:] = row
        dist.all_gather(self._parts, self._mine, group=self.group)
        return [view.tolist() for view in self._views[1]]


def disagreement(rows: list[list[int]], step_id: int, rank_text=lambda index: f"rank {index}") -> str | None:
    """None when every row holds `step_id` and one digest; else which rank decided what.
    `rank_text(index)` names the index-th member of the group."""
    steps = {row[0] for row in rows}
    if steps != {step_id}:
        return f"its ranks are at different steps ({', '.join(f'{rank_text(i)}: {r[0]}' for i, r in enumerate(rows))})"
    digests = {index: row[1] for index, row in enumerate(rows)}
    if len(set(digests.values())) == 1:
        return None
    reference, odd, majority = outvoted(digests)
    decisions = [dict(zip(FIELDS, row[2:])) for row in rows]
    name, mine, theirs = first_difference(decisions[odd], decisions[reference])
    what = "sampled other tokens" if name == TOKENS else f"decided {name}={mine}"
    whose = "" if majority else " (no majority: which one is wrong is not known)"
    return (f"{rank_text(odd)} {what} where {rank_text(reference)}"
            f" {'did not' if name == TOKENS else f'decided {name}={theirs}'}{whose} (online consensus)")
