"""tests/support/markers.py: what a child's command line starts (the honest-markers check reads it)."""

from __future__ import annotations

import sys

import pytest

from tests.support.markers import kinds_of_command

PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "kinds"),
    [
        ([PY, "-m", "palaestra.cli", "engine", "serve", "--model", "tiny"], {"engine"}),
        ([PY, "-m", "sglang.launch_server", "--model-path", "m"], {"engine"}),
        ([PY, "-m", "palaestra.cli", "gateway", "serve", "--model", "tiny"], set()),
        ([PY, "-m", "palaestra.testing.zero", "--port", "1"], set()),  # the zero-work TEST DOUBLE
        ([PY, "-m", "palaestra.cli", "train", "configs/demo.yaml"], {"ray"}),
        (["palaestra", "train", "--help"], set()),
        ([PY, "-c", "from palaestra.orchestrator.cluster import init_ray; init_ray()"], {"ray"}),
        (["/x/docker-compose", "-f", "docker-compose.yml", "-p", "p", "up", "-d", "--wait"], {"docker"}),
        (["/x/docker-compose", "-f", "docker-compose.yml", "config", "-q"], set()),  # needs no engine
        ("docker run --rm busybox true", {"docker"}),
        (["node", "/x/playwright/driver/package/cli.js", "run-driver"], {"browser"}),
        (["git", "apply", "fix.diff"], set()),
    ],
)
def test_a_command_line_says_what_it_starts(argv, kinds):
    assert kinds_of_command(argv) == kinds
