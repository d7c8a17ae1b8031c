"""Where an actor runs: its node's addresses (what a server binds and advertises) and a one-line
description of the node for the placement printed at start. Ray is imported when a function needs it."""

from __future__ import annotations

__all__ = ["WILDCARD_HOSTS", "node_address", "single_node", "where"]

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def node_address(host: str) -> tuple[str, str]:
    """(address to connect to from this node, address to advertise to other nodes) for a bind host.

    Loopback stays loopback; a wildcard bind is reached locally on 127.0.0.1 and advertised as the
    node's IP (as Ray sees it); a specific address is both.
    """
    if host in WILDCARD_HOSTS:
        import ray

        return "127.0.0.1", ray.util.get_node_ip_address()
    return host, host


def where() -> str:
    """This actor's node, for the placement printed at start: "<address> (node <id prefix>)"."""
    import ray

    return f"{ray.util.get_node_ip_address()} (node {ray.get_runtime_context().get_node_id()[:8]})"


def single_node() -> bool:
    """Whether the Ray cluster has one live node."""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1
