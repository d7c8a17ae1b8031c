"""Fixtures every test folder shares: the `tiny` preset (built once per session), its tokenizer,
and a running embedded engine. Each folder's conftest.py holds what only its tests share; helpers
that are not fixtures (servers, the scripted engine, sandbox backends, docker) are in tests/support/."""

from __future__ import annotations

import os

import httpx
import pytest

# Markers kept honest (a test that starts an engine, Ray, docker or a browser is marked) and the
# xdist groups of `make test` (tests/support/markers.py); each worker's tests in time, when
# PALAESTRA_TEST_TIMELINE names a file (tests/support/timeline.py).
pytest_plugins = ["tests.support.markers", "tests.support.timeline"]

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _generated_swe(tmp_path_factory, name: str, kinds: tuple[str, ...] | None = None) -> os.PathLike:
    """The bundled ``textkit`` repository's generated swe instances, one per bug kind in `kinds`
    (None: every kind), as JSONL."""
    import asyncio

    from palaestra.environments.swe_agent.generate import generate
    from palaestra.environments.swe_agent.mutate import KINDS
    from tests.support.doubles import SubprocessBackendForTests

    out = tmp_path_factory.mktemp(name) / f"{name}.jsonl"
    instances = asyncio.run(
        generate(
            out,
            SubprocessBackendForTests(),
            per_kind=1,
            repos=["textkit"],
            tries_per_kind=4,
            kinds=kinds or KINDS,
        )
    )
    assert instances, "no instance generated"
    assert {i.bug_kind for i in instances} <= set(kinds or KINDS), instances  # only the kinds asked
    return out


@pytest.fixture(scope="session")
def swe_data(tmp_path_factory):
    """One generated swe instance per mutation kind of the bundled ``textkit`` repository, as JSONL:
    generated once per test process (the sandbox validates every candidate: ~20 s), read only."""
    return _generated_swe(tmp_path_factory, "swe")


@pytest.fixture(scope="session")
def swe_instance(tmp_path_factory):
    """`swe_data` of the first mutation kind only (``off_by_one``): for a test that needs one
    generated instance (a train run of one task), a fifth of the sandbox runs."""
    return _generated_swe(tmp_path_factory, "swe-one", ("off_by_one",))


@pytest.fixture(scope="session")
def tiny_model_dir():
    from palaestra.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tok(tiny_model_dir):
    """The `tiny` preset's tokenizer (Qwen2.5's chat template). Tests that change it load their own."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def _tok_unchanged(request):
    """The shared `tok` leaves a test as it came: one that rewrote its chat template would change
    what every later test renders (on whichever worker it lands), so it fails here, by name."""
    if "tok" not in request.fixturenames:
        yield
        return
    tok = request.getfixturevalue("tok")
    before = (tok.chat_template, len(tok))
    yield
    assert (tok.chat_template, len(tok)) == before, (
        f"{request.node.nodeid} changed the shared `tok` fixture; load a tokenizer of its own"
    )


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
