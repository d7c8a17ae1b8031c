"""Docker for the tests: whether an engine answers, the compose sandbox fleet brought up and torn
down, and the memory the tests' containers hold (read from the engine, so nothing the code inside
them does can fake it).

Where no engine answers, ``require_engine()`` skips with the reason, which ``-ra`` prints in the
summary; ``.ci/run`` starts an engine when it runs as root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
FLEET_PROJECT = f"palaestra-test-fleet-{os.getpid()}"
"""This test run's compose project (other runs on the same engine have their own)."""


def engine() -> Any | None:
    """A docker client whose engine answered a ping, or None."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
        return client
    except docker.errors.DockerException:
        return None


def require_engine() -> Any:
    client = engine()
    if client is None:
        pytest.skip(
            "no docker engine answers (.ci/run starts one when it runs as root); docker tests skipped"
        )
    return client


def compose(
    *args: str, env: dict[str, str] | None = None, project: str = FLEET_PROJECT, timeout: float = 300
):
    """Compose v2 on the repository's docker-compose.yml (see sandbox/fleet.py)."""
    from palaestra.sandbox.fleet import compose as run_compose

    return run_compose(COMPOSE_FILE, project, *args, env=env or {}, timeout=timeout)


@dataclass
class Fleet:
    url: str
    api_key: str


@contextlib.contextmanager
def compose_fleet(label: str, replicas: int = 2) -> Iterator[Fleet]:
    """``docker compose up --wait`` of the default services (exec-server replicas + front) on a
    free loopback port; ``down -v`` afterwards, whatever happened."""
    from palaestra.net import free_port
    from palaestra.sandbox.fleet import FleetError, running_fleet
    from palaestra.sandbox.images import build

    client = require_engine()
    build.ensure_image(client, "server")
    key = secrets.token_hex(16)
    try:
        with running_fleet(
            COMPOSE_FILE, api_key=key, port=free_port(), project=FLEET_PROJECT, replicas=replicas, label=label
        ) as url:
            yield Fleet(url, key)
    except FleetError as exc:
        pytest.fail(str(exc))


def containers_memory_mb(client: Any, label: str, owner_pid: int | None = None) -> int:
    """What the memory cgroups of the containers carrying ``label`` (a docker label filter, e.g.
    "palaestra-test" or "com.docker.compose.project=NAME") hold: usage less reclaimable cache.
    ``owner_pid``: only the docker backend's containers that this process owns."""
    total = 0
    for c in client.containers.list(filters={"label": label}):
        owner = c.labels.get(f"{label}.owner", "")
        if owner_pid is not None and owner.split(":")[1:2] != [str(owner_pid)]:
            continue
        mem = client.api.stats(c.id, stream=False, one_shot=True).get("memory_stats", {})
        stats = mem.get("stats", {})
        total += mem.get("usage", 0) - stats.get("total_inactive_file", stats.get("inactive_file", 0))
    return total >> 20
