"""Fixtures the environment tests share."""

from __future__ import annotations

import asyncio

import pytest

from palaestra.environments.swe_agent.generate import generate
from tests.support.doubles import SubprocessBackendForTests


@pytest.fixture(scope="module")
def swe_data(tmp_path_factory):
    """One generated swe instance per mutation kind of the bundled ``textkit`` repository, as JSONL
    (generated once per module: the sandbox validates every candidate)."""
    out = tmp_path_factory.mktemp("swe") / "swe.jsonl"
    instances = asyncio.run(
        generate(out, SubprocessBackendForTests(), per_kind=1, repos=["textkit"], tries_per_kind=4)
    )
    assert instances, "no instance generated"
    return out
