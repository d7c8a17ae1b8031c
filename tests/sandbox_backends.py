"""Sandbox backends for the environment and grader tests: the labelled subprocess TEST DOUBLE
(fast, no isolation) and the real local bubblewrap backend, which skips with the reason when it
cannot run on this machine."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import pytest

from palaestra.sandbox.base import Backend
from palaestra.verifiers.testing import SubprocessBackendForTests


@functools.cache  # probing starts a sandbox: once per test session
def local_backend_or_reason() -> tuple[Callable[[], Backend] | None, str]:
    """The real local backend's factory, or why there is none here."""
    try:
        from palaestra.sandbox import get_backend
    except ImportError as exc:
        return None, f"palaestra.sandbox has no get_backend yet: {exc}"

    def make() -> Backend:
        return get_backend("local")

    async def probe() -> str:
        backend = make()
        try:
            box = await backend.create("python")
            try:
                result = await box.exec(["python3", "-c", "print(1)"])
            finally:
                await box.close()
        finally:
            await backend.close()
        return (
            "" if result.ok else f"local sandbox cannot run python3: {result.status} {result.stderr[-300:]}"
        )

    try:
        reason = asyncio.run(probe())
    except Exception as exc:  # no bwrap, no user namespaces
        reason = f"local sandbox backend unavailable: {type(exc).__name__}: {exc}"
    return (None, reason) if reason else (make, "")


def backend_params() -> list:
    """pytest params: the test double, and the local backend (or a visible skip)."""
    make, reason = local_backend_or_reason()
    local = (
        pytest.param(make, id="local")
        if make
        else pytest.param(None, id="local", marks=pytest.mark.skip(reason=reason))
    )
    return [pytest.param(SubprocessBackendForTests, id="test-double"), local]
