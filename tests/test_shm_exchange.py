"""The shared-memory exchange the online consensus check uses among ranks of one host
(`runner_fsm.agree.shm_exchange`), in real processes (`engine.launch.spawn`, gloo for its set-up)."""

from __future__ import annotations

import glob

import pytest

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.launch import spawn

pytestmark = pytest.mark.multiproc


def _rows_each_step(groups, steps: int) -> list:
    """Every exchange's rows through shared memory and through gloo, for the same rows."""
    from runner_fsm.agree.shm_exchange import ShmExchange, replica_exchange
    from runner_fsm.agree.consensus import ConsensusExchange

    group, rank = groups.pcp, groups.pcp_rank
    shm = replica_exchange(group, 3, timeout_s=30)
    assert isinstance(shm, ShmExchange)
    gloo = ConsensusExchange(group)
    rows = [[step, rank * 1000 + step, -(2 ** 62) + rank] for step in range(steps)]  # any int64
    by_shm = [shm(row) for row in rows]  # back to back: nothing else keeps the ranks in step
    return list(zip(by_shm, [gloo(row) for row in rows]))


def test_every_rank_reads_every_peers_row_of_each_exchange(tmp_path):
    """Three ranks, 300 exchanges back to back (the two slots reused 150 times each): each
    rank reads, each time, exactly the rows gloo gathers; the segment's name is gone once set
    up. Mutation: one slot instead of two (parity 0 always) -> a fast rank overwrites a row its
    peer has not read yet, and the rows differ or the exchange times out."""
    results = spawn(_rows_each_step, ParallelLayout(1, 3), 300, timeout_s=120)
    for out in results:
        assert all(shm == gloo for shm, gloo in out), next((s, g) for s, g in out if s != g)
        assert [rows[1][1] for rows, _ in out] == [1000 + s for s in range(300)]
    assert not glob.glob("/dev/shm/runner-fsm-*")


def _one_rank_stops(groups, stopper: int) -> str:
    from runner_fsm.errors import CollectiveTimeout
    from runner_fsm.agree.shm_exchange import replica_exchange

    exchange = replica_exchange(groups.pcp, 2, timeout_s=1.0)
    rank = groups.pcp_rank
    exchange([0, rank])
    if rank == stopper:
        return "stopped"
    try:
        exchange([1, rank])
    except CollectiveTimeout as err:
        return str(err)
    return "no timeout"


@pytest.mark.parametrize("stopper", [0, 2])
def test_a_rank_that_never_comes_is_named_after_the_timeout(stopper):
    """The first and the last rank stop exchanging after #1: each other rank fails #2 within
    about the timeout, naming it and the exchange it is at. Mutation: no deadline -> the
    spawn's own timeout fails the test."""
    results = spawn(_one_rank_stops, ParallelLayout(1, 3), stopper, timeout_s=60)
    for rank, message in enumerate(results):
        if rank == stopper:
            assert message == "stopped"
        else:
            assert f"rank {stopper} of the group never wrote its row" in message and "#2" in message, message
            assert "at exchange #1" in message, message


def _other_hosts(groups) -> str:
    import socket

    from runner_fsm.agree.shm_exchange import replica_exchange

    if groups.pcp_rank == 1:
        socket.gethostname = lambda: "another-host"  # this process only: as if rank 1 ran elsewhere
    exchange = replica_exchange(groups.pcp, 2, timeout_s=5)
    rows = exchange([7, groups.pcp_rank])
    return f"{type(exchange).__name__} {rows}"


def test_ranks_on_different_hosts_fall_back_to_gloo():
    """Evidence of a shared host missing: every rank takes gloo, and the rows still arrive.
    Mutation: the host check on one rank only -> the ranks disagree on the transport and hang."""
    results = spawn(_other_hosts, ParallelLayout(1, 2), timeout_s=60)
    assert results == ["ConsensusExchange [[7, 0], [7, 1]]"] * 2


def _segment_kind(groups, peer_cannot_open: bool) -> tuple:
    """Which segment the exchange mapped (its line in /proc/self/maps), and its rows; with
    `peer_cannot_open`, the last rank cannot open the first rank's anonymous segment (as from
    another PID namespace)."""
    from runner_fsm.agree import shm_exchange

    if peer_cannot_open and groups.pcp_rank == 2:
        def refuse(address):
            raise PermissionError("no access to another process's descriptors here")
        shm_exchange._open_anonymous = refuse
    exchange = shm_exchange.replica_exchange(groups.pcp, 2, timeout_s=10)
    rows = exchange([3, groups.pcp_rank])
    with open("/proc/self/maps") as maps:
        lines = [line.strip() for line in maps if "runner-fsm-exchange" in line or "/dev/shm/runner-fsm-" in line]
    kinds = {"anonymous" if "/memfd:runner-fsm-exchange" in line else "named" for line in lines}
    return sorted(kinds), rows, all(line.endswith("(deleted)") for line in lines)


@pytest.mark.parametrize("peer_cannot_open", [False, True], ids=["memfd", "fallback-named"])
def test_the_segment_has_no_name_unless_a_rank_cannot_open_it(peer_cannot_open):
    """Every rank maps an anonymous segment (nothing a SIGKILL could leave in /dev/shm); where one
    rank cannot open it, every rank falls back to a named one under /dev/shm, gone once set up.
    Mutation: peers opening the name only (no memfd) -> "named" in the first case."""
    results = spawn(_segment_kind, ParallelLayout(1, 3), peer_cannot_open, timeout_s=60)
    want = ["named"] if peer_cannot_open else ["anonymous"]
    assert [kinds for kinds, _, _ in results] == [want] * 3, results
    assert all(unlinked for _, _, unlinked in results), results  # a named one's name gone once mapped
    assert all(rows == [[3, 0], [3, 1], [3, 2]] for _, rows, _ in results), results


@pytest.mark.parametrize("rank", [0, 2])
def test_a_new_generation_beside_the_previous_rows_is_not_taken(rank):
    """A CPU that reorders stores may show a reader the new generation g while the slot still
    holds the row and crc written for g - 2 (the slot's previous use, same parity), which agree
    with each other. With the generation inside the checksum the reader takes nothing and reads
    again; then the whole write of g is taken. Mutation: the crc over the row alone -> the stale
    row is returned."""
    import numpy as np

    from runner_fsm.agree.shm_exchange import slot_row, write_slot

    slots = np.zeros((3, 2, 4 + 2), dtype=np.int64)
    slot = slots[rank, 1]  # generations 5 and 7 share parity 1
    write_slot(slot, 5, [5, 55, 555, 5555])
    assert slot_row(slot, 5) == [5, 55, 555, 5555]
    slot[0] = 7  # g = 7 visible before its row and crc
    assert slot_row(slot, 7) is None
    slot[2:] = [7, 77, 777, 7777]  # the row, its crc still g - 2's
    assert slot_row(slot, 7) is None
    write_slot(slot, 7, [7, 77, 777, 7777])
    assert slot_row(slot, 7) == [7, 77, 777, 7777] and slot_row(slot, 5) is None
