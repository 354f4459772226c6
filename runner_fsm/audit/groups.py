"""Which ranks must issue the same collectives: the members of each process group.

Every collective record carries its group's name; the instance of the group a rank is in
follows from the layout (`ParallelLayout.dp_group_ranks`, `pcp_group_ranks`, `expert_group_ranks`):
- `dp`: one group per PCP rank, over the replicas (the DP agreement's group);
- `pcp`: one group per replica, over its PCP ranks;
- anything else (`expert`, ...): one group over every rank.
"""

from __future__ import annotations

from runner_fsm.audit.reader import RankInfo


def instance_key(group: str, info: RankInfo) -> tuple:
    if group == "dp":
        return ("dp", info.pcp_rank)
    if group == "pcp":
        return ("pcp", info.dp_rank)
    return (group,)


class Groups:
    """Group instances of a run, memoised: `instance(group, rank)`, `members(key)`."""

    def __init__(self, infos: list[RankInfo]):
        self.infos = {info.global_rank: info for info in infos}
        self._instance: dict[tuple[str, int], tuple] = {}
        self._members: dict[tuple, tuple[int, ...]] = {}

    def instance(self, group: str, rank: int) -> tuple:
        key = self._instance.get((group, rank))
        if key is None:
            key = self._instance[(group, rank)] = instance_key(group, self.infos[rank])
        return key

    def members(self, group: str, key: tuple) -> tuple[int, ...]:
        found = self._members.get(key)
        if found is None:
            found = self._members[key] = tuple(r for r in sorted(self.infos) if self.instance(group, r) == key)
        return found

    def replica(self, rank: int) -> int:
        return self.infos[rank].dp_rank

    def replicas_text(self, ranks) -> str:
        """'replica 1 (ranks 2, 3)' for a set of ranks, grouped by replica."""
        by_replica: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_replica.setdefault(self.replica(rank), []).append(rank)
        return "; ".join(f"replica {d} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                         for d, rs in sorted(by_replica.items()))
