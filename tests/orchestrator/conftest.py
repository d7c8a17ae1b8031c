"""Fixtures the orchestrator tests share: one local Ray for every module of a test process
(`ray_local`)."""

from __future__ import annotations

import sys

import pytest

from tests.support.runs import local_ray


@pytest.fixture(scope="session")
def _ray_until_the_end():
    """Stops, when the test process ends, the local Ray `ray_local` left running."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_until_the_end):
    """The local Ray of the module; its workers import the tests' environments by path. Started by
    the first module that asks and left running for the next (`make test` runs every Ray test in
    one process: a start and a shutdown per module cost seconds each); test_multinode.py, which
    needs a cluster of its own, stops it, and the next module starts it again."""
    local_ray()
    yield
