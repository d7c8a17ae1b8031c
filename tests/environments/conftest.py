"""Fixtures the environment tests share."""

from __future__ import annotations

import asyncio

import pytest

from palaestra.environments.swe_agent.generate import generate
from tests.support.sandbox import SANDBOX_BACKENDS


@pytest.fixture(scope="module")
def swe_real(tmp_path_factory):
    """`palaestra swe generate --real`'s path over inflection's sdist (its own pytest suite), on the
    local (bubblewrap) backend, with environments built offline from `palaestra swe fetch`'s
    packages in a fresh cache: (the JSONL, the `EnvOptions` to build its environments with)."""
    from palaestra.environments.swe_agent.generate import sdist_source
    from palaestra.environments.swe_agent.repo_env import EnvOptions, packages_dir
    from tests.support.sandbox_backends import backend_for

    sdist = packages_dir() / "inflection-0.5.1.tar.gz"
    if not sdist.exists() or not list(packages_dir().glob("pytest-*.whl")):
        pytest.skip(
            f"no inflection sdist or pytest wheel in {packages_dir()}: run `palaestra swe fetch` (make install does)"
        )
    tmp = tmp_path_factory.mktemp("swe-real")
    options = EnvOptions(str(tmp / "envs"), (str(packages_dir()),), index=False)
    out = tmp / "real.jsonl"
    with backend_for("local") as local:
        made = asyncio.run(
            generate(
                out, local, sources=[sdist_source(sdist)], per_kind=1, tries_per_kind=2, env_options=options
            )
        )
    assert made, "no instance generated from inflection"
    from palaestra.environments.swe_agent.instance import load_jsonl

    assert [i.instance_id for i in load_jsonl(out)] == [i.instance_id for i in made]  # all written
    return out, options


@pytest.fixture(scope="module")
def local_sandbox():
    """A sandbox of the local (bubblewrap) backend, for the module's tests."""
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    with SANDBOX_BACKENDS["local"]() as make:
        yield make()
