"""Fixtures the sandbox tests share: every backend by name (`sandbox_backend`, parametrized over
tests/support/sandbox.py's registry; new backends register there) and an event loop to drive them."""

from tests.support.sandbox import loop_runner, sandbox_backend  # noqa: F401
