"""Which TCP sockets a process tree listens on, read from Linux /proc (for tests/test_loopback.py
and any test that checks a server's bind address).

`listening(pid)` is the LISTEN sockets of /proc/net/tcp{,6} whose inodes are among the open files
of `pid` and its descendants; `assert_loopback_only` fails naming every one off loopback.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = ["assert_loopback_only", "is_loopback", "listening", "process_tree"]


def process_tree(pid: int) -> set[int]:
    """`pid` and all its descendants."""
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # /proc prints the address as 32-bit words in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by `pid` or its descendants."""
    inodes = _socket_inodes(process_tree(pid))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                ip, port = local.split(":")
                found.add((_address(ip), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4-mapped ::ffff:127.x (Ray's servers; Python 3.11's `is_loopback`
    says False for those)."""
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def assert_loopback_only(name: str, pid: int, expected_ports: set[int]) -> set[tuple[str, int]]:
    sockets = listening(pid)
    exposed = {s for s in sockets if not is_loopback(s[0])}
    assert not exposed, f"{name} listens beyond loopback: {sorted(exposed)} (all: {sorted(sockets)})"
    assert expected_ports <= {port for _, port in sockets}, (
        f"{name}: {sorted(sockets)} lacks {expected_ports}"
    )
    return sockets
