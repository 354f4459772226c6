"""A row of integers from every rank of a group whose ranks share a host, through shared memory.

The online consensus check (`step_consensus`) exchanges a few integers per step among the ranks
of a replica. Over gloo that is a TCP round trip through the kernel and a wake-up of each peer:
about 350 us on a 2-core box, seven times the check's budget. The ranks of a replica (its TP
and PCP peers) usually share a host, and there a shared page does it in microseconds; vLLM
passes its own per-step CPU messages within a node the same way (its shared-memory message
queue). Where the ranks do not share a host, `replica_exchange` falls back to gloo.

The segment holds, per rank, two slots (the exchange's parity): [generation, crc32 of the
generation and the row, row...]. A rank writes its row, then its crc, then the generation last,
and reads each peer's slot of this generation once the generation is there and the crc matches
that generation and the row it read. The generation is inside the checksum because a CPU that
reorders stores (ARM, POWER) may show a reader the new generation beside the row and crc of the
slot's previous use, two generations old, which agree with each other: read again, never taken.
Two slots suffice: a rank cannot start generation g + 2 before every peer has written g + 1,
which each writes only after reading g. A peer that never comes is named after `timeout_s`
(`CollectiveTimeout`), with the generation it was last at: the check does not wait for ever.

Set-up is collective over `group` (gloo): the hosts are compared, then the group's first rank
makes the segment and the others map it. A SIGKILL at any moment must leave nothing behind, so
the segment has no name in any file system: an anonymous file in memory (Linux `memfd_create`),
which the others open through `/proc/<first rank's pid>/fd/<descriptor>` (checked to be that
file: same device and inode) while the first rank holds it open; it is freed with the last
mapping. Where that cannot be (no `memfd_create`; ranks in different PID namespaces, or a /proc
that hides the first rank's descriptors), a file under /dev/shm with a random name, unlinked once
every rank has mapped it: a crash in that set-up leaves the file behind. Where neither can be,
the group is `NotOneHost`: gloo carries the rows.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
import zlib

import numpy as np

from runner_fsm.errors import CollectiveTimeout

SHM_DIR = "/dev/shm"
_SPINS = 200  # reads of a peer's generation before yielding the CPU (a peer at the same point is there at once)


class NotOneHost(RuntimeError):
    """The group's ranks do not share a host (or no segment can be shared among them)."""


class ShmExchange:
    """`exchange(row)` -> every rank's row, in group order (the gloo `ConsensusExchange`'s API)."""

    def __init__(self, group, width: int, timeout_s: float):
        import socket

        import torch.distributed as dist

        self.width, self.timeout_s = int(width), float(timeout_s)
        size, self.index = dist.get_world_size(group), dist.get_rank(group)
        hosts: list = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            raise NotOneHost(f"the group's ranks are on {sorted(set(hosts))}")
        self._map = _shared_segment(group, self.index, size * 2 * (self.width + 2) * 8)
        self._slots = np.ndarray((size, 2, self.width + 2), dtype=np.int64, buffer=self._map)
        self._generation = 0

    def __call__(self, row: list[int]) -> list[list[int]]:
        if len(row) != self.width:
            raise ValueError(f"a row of {len(row)} integers where this exchange carries {self.width}")
        self._generation = generation = self._generation + 1
        parity = generation & 1
        write_slot(self._slots[self.index, parity], generation, row)
        rows = []
        for peer in range(len(self._slots)):
            rows.append(list(row) if peer == self.index else self._read(peer, parity, generation))
        return rows

    def _read(self, peer: int, parity: int, generation: int) -> list[int]:
        slot = self._slots[peer, parity]
        spins, deadline = 0, None
        while True:
            values = slot_row(slot, generation)
            if values is not None:
                return values
            spins += 1
            if spins % _SPINS == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    raise CollectiveTimeout(
                        f"shared-memory exchange #{generation}: rank {peer} of the group never wrote its row"
                        f" within {self.timeout_s:g} s (it is at exchange #{max(slot[0], self._slots[peer, 1 - parity][0])})")
                time.sleep(0 if spins < 50 * _SPINS else 0.0005)  # yield; past ~10k reads, stop spinning

    def close(self) -> None:
        self._slots = None
        self._map.close()


def _shared_segment(group, index: int, nbytes: int) -> mmap.mmap:
    """A segment of `nbytes` every rank of `group` has mapped (collective): anonymous if every
    rank can open it, else named under /dev/shm and unlinked once mapped (NotOneHost: neither)."""
    for make, open_peer in ((_make_anonymous, _open_anonymous), (_make_named, _open_named)):
        mapping = _set_up(group, index, nbytes, make, open_peer)
        if mapping is not None:
            return mapping
    raise NotOneHost("no shared segment every rank of the group can map (no memfd through /proc, no /dev/shm)")


def _set_up(group, index: int, nbytes: int, make, open_peer) -> mmap.mmap | None:
    """The first rank makes the segment (`make` -> (fd, address, forget) or None), the others
    open it by its address; every rank says whether it mapped it, which is also the barrier
    after which the first rank lets go of it (`forget`). None on every rank if one failed."""
    import torch.distributed as dist

    made = None
    if index == 0:
        with contextlib.suppress(OSError):
            made = make(nbytes)
    address = [made[1] if made is not None else None]
    dist.broadcast_object_list(address, src=dist.get_global_rank(group, 0), group=group)
    mapping = None
    if address[0] is not None:
        with contextlib.suppress(OSError, ValueError):
            fd = made[0] if index == 0 else open_peer(address[0])
            try:
                mapping = mmap.mmap(fd, nbytes)
            finally:
                if index != 0:
                    os.close(fd)
    mapped: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(mapped, mapping is not None, group=group)  # every rank has it (or not)
    if made is not None:
        made[2]()
    if all(mapped):
        return mapping
    if mapping is not None:
        mapping.close()
    return None


def _make_anonymous(nbytes: int):
    if not hasattr(os, "memfd_create"):
        return None
    fd = os.memfd_create("runner-fsm-exchange")
    os.ftruncate(fd, nbytes)
    st = os.fstat(fd)
    return fd, (os.getpid(), fd, st.st_dev, st.st_ino), lambda: os.close(fd)


def _open_anonymous(address) -> int:
    pid, number, dev, ino = address
    fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):  # that pid is another process here (another PID namespace)
        os.close(fd)
        raise OSError(f"/proc/{pid}/fd/{number} is not the group's segment")
    return fd


def _make_named(nbytes: int):
    if not os.path.isdir(SHM_DIR):
        return None
    name = f"{SHM_DIR}/runner-fsm-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)

    def forget() -> None:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    return fd, name, forget


def _open_named(name: str) -> int:
    return os.open(name, os.O_RDWR)


def _checksum(generation: int, row: np.ndarray) -> int:
    return zlib.crc32(row.tobytes(), zlib.crc32(generation.to_bytes(8, "little", signed=True)))


def write_slot(slot: np.ndarray, generation: int, row) -> None:
    """[generation, crc, row...]: the row, then its checksum (with the generation), the generation last."""
    slot[2:] = row
    slot[1] = _checksum(generation, slot[2:])
    slot[0] = generation  # last: a peer reads the row once it sees this


def slot_row(slot: np.ndarray, generation: int) -> list[int] | None:
    """The row a peer wrote for `generation`, or None while the slot does not hold it whole (not
    there yet, torn, or the previous use's row and crc beside the new generation)."""
    if slot[0] != generation:
        return None
    crc, values = int(slot[1]), slot[2:].copy()
    if crc != _checksum(generation, values) or slot[0] != generation:
        return None
    return values.tolist()


def replica_exchange(group, width: int, timeout_s: float):
    """The cheapest exchange for `group`: shared memory where its ranks share a host, else one
    gloo all_gather per call (`step_consensus.ConsensusExchange`). Collective: every rank of
    the group calls it at the same point."""
    from runner_fsm.agree.consensus import ConsensusExchange

    try:
        return ShmExchange(group, width, timeout_s)
    except NotOneHost:
        return ConsensusExchange(group)
