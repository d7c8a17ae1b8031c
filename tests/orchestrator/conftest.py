"""Fixtures the orchestrator tests share: one local Ray per module (`ray_local`)."""

from __future__ import annotations

import pytest

from tests.support.runs import local_ray


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module; its workers import the tests' environments by path."""
    with local_ray():
        yield
