"""torch.distributed rendezvous stores that listen only on the address they are given.

torch's own rendezvous (``env://``, ``tcp://host:port``, `torch.distributed.TCPStore(host, ...)`)
starts rank 0's TCP store on the wildcard address whatever ``host`` says: in torch 2.13 both store
backends (libuv, the default, and the legacy one) bind ``[::]:port`` (every interface, IPv4
included) and use ``host`` only to connect to it. A trainer on one machine with ``MASTER_ADDR=127.0.0.1``
would still be reachable from the network on its rendezvous port. `TCPStore`'s ``master_listen_fd``
argument is the one way to choose the address: rank 0 binds a socket itself and the store serves
on it (the store owns the socket from then on). `tcp_store` does that; every other rank connects
as before, so the store's keys are exactly those of torch's ``tcp://`` rendezvous and a process
that rendezvouses the plain way (an SGLang engine joining the weight-update group) meets it.

    store = tcp_store("127.0.0.1", 29500, rank, world_size, timedelta(minutes=5))
    dist.init_process_group("gloo", store=PrefixStore("default_pg", store), rank=rank, world_size=world_size)

`store_address(init_method)` says where an ``init_method`` rendezvouses (None for ``file://``,
which opens no socket). `is_loopback(host)` tells a one-machine rendezvous apart.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["is_loopback", "store_address", "tcp_store"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def store_address(init_method: str | None) -> tuple[str, int] | None:
    """(host, port) of the TCP store an ``init_method`` rendezvouses at: ``env://`` (or None) reads
    MASTER_ADDR/MASTER_PORT, ``tcp://host:port`` names it; None for anything else (``file://``),
    for URLs with query options, and under torchrun's agent store (its agent hosts the store and
    every rank is a client): those are left to torch."""
    method = init_method or "env://"
    parts = urlsplit(method)
    if parts.query or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if parts.scheme == "env":
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ValueError("env:// rendezvous needs MASTER_ADDR and MASTER_PORT in the environment")
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if parts.scheme == "tcp" and parts.hostname and parts.port is not None:
        return parts.hostname, parts.port
    return None


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(f"the rendezvous store could not listen on {host}:{port}: {exc}") from exc
    return sock


def tcp_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> torch.distributed.TCPStore:
    """Rank 0: a store listening on `host`:`port` only (waits for the other ranks to connect, as
    torch's rendezvous does); other ranks: a client of it."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = _listen(host, port)
    bound_port = listener.getsockname()[1]
    return TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listener.detach(),  # the store closes it when it shuts down
        use_libuv=True,
    )
