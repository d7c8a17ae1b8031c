"""Sandbox backends for the environment and grader tests: the labelled subprocess TEST DOUBLE
(fast, no isolation), the real local bubblewrap backend and the docker backend; a real one that
cannot run on this machine is a visible skip with the reason."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import pytest

from palaestra.sandbox.base import Backend
from palaestra.verifiers.testing import SubprocessBackendForTests

REAL_BACKENDS = ("local", "docker")


@functools.cache  # probing starts a sandbox: once per test session and backend
def backend_or_reason(spec: str) -> tuple[Callable[[], Backend] | None, str]:
    """A factory of the real backend ``spec`` ("local", "docker"), or why there is none here."""
    from palaestra.environments.episode import resolve_backend

    def make() -> Backend:
        return resolve_backend(spec)

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
            "" if result.ok else f"{spec} sandbox cannot run python3: {result.status} {result.stderr[-300:]}"
        )

    try:
        reason = asyncio.run(probe())
    except Exception as exc:  # no bwrap or user namespaces; no docker daemon
        reason = f"{spec} sandbox backend unavailable here: {type(exc).__name__}: {exc}"
    return (None, reason) if reason else (make, "")


def backend_params() -> list:
    """pytest params: the test double, then each real backend (or a visible skip)."""
    params = [pytest.param(SubprocessBackendForTests, id="test-double")]
    for spec in REAL_BACKENDS:
        make, reason = backend_or_reason(spec)
        params.append(
            pytest.param(make, id=spec)
            if make
            else pytest.param(None, id=spec, marks=pytest.mark.skip(reason=reason))
        )
    return params
