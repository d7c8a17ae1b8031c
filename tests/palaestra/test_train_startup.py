"""What every `palaestra train` prints as Ray starts: no token-authentication warning, auth still on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys
from palaestra.orchestrator.cluster import init_ray
assert "ray" not in sys.modules  # as in `palaestra train`: Ray is first imported by init_ray
init_ray("127.0.0.1", num_cpus=1)
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode
@ray.remote
def mode():
    return os.environ.get("RAY_AUTH_MODE")
print("driver", get_authentication_mode() == AuthenticationMode.TOKEN, "worker", ray.get(mode.remote()))
ray.shutdown()
"""


@pytest.mark.slow  # starts a local Ray: 5-30 s
@pytest.mark.ray
def test_a_local_ray_starts_with_token_auth_on_and_no_warning():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "driver True worker token"
    assert "Token authentication" not in r.stderr + r.stdout, r.stderr
