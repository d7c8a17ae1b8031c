"""Shared fixtures: the `tiny` preset (built once per session) and a running embedded engine."""

from __future__ import annotations

import os

import httpx
import pytest

# Sandbox backends by name, for tests/test_sandbox_*.py (new backends register in that file).
from tests.sandbox_fixtures import loop_runner, sandbox_backend  # noqa: F401

# Markers kept honest (a test that starts an engine, Ray, docker or a browser is marked) and the
# xdist groups of `make test` (tests/support/markers.py).
pytest_plugins = ["tests.support.markers"]

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir():
    from palaestra.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """A `palaestra engine serve --model tiny` subprocess on a free loopback port."""
    from palaestra.engine.cli import engine_process

    with engine_process("tiny", extra_args=["--num-threads", "1"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=120, trust_env=False) as c:
        yield c
