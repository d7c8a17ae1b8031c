"""`.ci/run` stops the dockerd it started only where nothing else runs containers on it (issue 37).

The functions run as `.ci/run` runs them (sourced from .ci/docker_engine.sh), with a stand-in
`docker` command (labelled: it only answers `ps -q`) and a sleeping process, in its own session, in
the place of the dockerd the run started."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _stop_engine(tmp_path: Path, containers: int) -> tuple[str, bool]:
    """Runs stop_docker_engine against a stand-in dockerd; its output and whether it still runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ids = "".join(f"c{i}\\n" for i in range(containers))
    (bin_dir / "docker").write_text(f'#!/bin/sh\n[ "$1" = ps ] && printf "{ids}"\nexit 0\n')
    (bin_dir / "docker").chmod(0o755)
    dockerd = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        script = f"source .ci/docker_engine.sh; DOCKERD_PID={dockerd.pid}; stop_docker_engine"
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        out = subprocess.run(
            ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        ).stdout
        if "stopping" in out:
            dockerd.wait(timeout=30)  # SIGTERM ends sleep at once; the bound is only a guard
        return out, dockerd.poll() is None
    finally:
        if dockerd.poll() is None:
            os.killpg(dockerd.pid, signal.SIGKILL)
            dockerd.wait()


def test_the_dockerd_this_run_started_is_stopped_when_no_container_runs_on_it(tmp_path):
    out, running = _stop_engine(tmp_path, containers=0)
    assert "stopping the dockerd this run started" in out
    assert not running


@pytest.mark.parametrize("containers", [1, 3])
def test_a_dockerd_that_runs_other_containers_is_left_running(tmp_path, containers):
    out, running = _stop_engine(tmp_path, containers=containers)
    assert "left running" in out and f"{containers} container(s)" in out
    assert running


def test_nothing_is_stopped_when_this_run_started_no_dockerd():
    out = subprocess.run(
        ["bash", "-c", 'source .ci/docker_engine.sh; DOCKERD_PID=""; stop_docker_engine; echo done'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "done"
