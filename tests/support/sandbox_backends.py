"""Sandbox backends for the grader and environment tests: the labelled subprocess TEST DOUBLE
(fast, no isolation), then every real backend that tests/support/sandbox.py registers for the
sandbox suite among ``REAL`` (local bubblewrap; docker once it registers) — set up, or skipped
with the reason, exactly as in the sandbox tests. A test module asks for them with

    @pytest.fixture(params=backend_names())
    def backend(request):
        with backend_for(request.param) as b:
            yield b
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from palaestra.sandbox.backends import BACKEND_NAMES
from palaestra.sandbox.base import Backend
from tests.support.doubles import SubprocessBackendForTests
from tests.support.sandbox import SANDBOX_BACKENDS, backend_param

REAL = BACKEND_NAMES


def backend_names() -> list:
    """Fixture params: the names, the docker ones marked `docker`."""
    return ["test-double", *(backend_param(name) for name in REAL if name in SANDBOX_BACKENDS)]


@contextlib.contextmanager
def backend_for(name: str) -> Iterator[Backend]:
    """A fresh backend of the kind ``name`` (a skip, with its reason, where it cannot run)."""
    if name == "test-double":
        yield SubprocessBackendForTests()
        return
    with SANDBOX_BACKENDS[name]() as make:
        yield make()
