"""The job's rendezvous on one address: rank 0's c10d store listens on `host` alone.

c10d's `tcp://` and `env://` init methods make rank 0's `TCPStore` listen on every interface
(IPv4 and IPv6, no authentication). Here the server's socket is bound to the address asked
for (loopback by default) and handed to `TCPStore` through its public `master_listen_fd`.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def rendezvous_store(host: str, port: int, is_server: bool, world_size: int, timeout) -> dist.TCPStore:
    """The job's c10d store. The server listens on a socket bound to `host` alone, handed to
    `TCPStore` through its public `master_listen_fd` (left to itself, it binds every interface).
    torch is imported here, by the ranks: the launcher, which needs only `free_port`, never loads it."""
    import torch.distributed as dist

    if not is_server:
        return dist.TCPStore(host, port, world_size, False, timeout)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        fd = listener.detach()  # from here on the store serves on it and owns it
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def is_loopback(host: str) -> bool:
    """A name or address of this machine's loopback interface."""
    return host in ("localhost", "::1") or host.startswith("127.")


def free_port(host: str) -> int:
    # The port is free now; rank 0 binds it a moment later (a small, accepted race).
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def under_torchrun() -> bool:
    """True in a process started by `torchrun` (or anything that sets its variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
