"""Isolated execution of untrusted, model-written code (see docs/sandbox.md).

    from palaestra.sandbox import Limits, SandboxPool, get_backend

    async with SandboxPool(get_backend("local"), size=4, limits=Limits(memory_mb=256)) as pool:
        async with pool.sandbox() as box:
            await box.upload("solution.py", source)
            result = await box.exec(["python3", "solution.py"], timeout=5)

Backends: ``LocalBackend`` (bubblewrap), ``DockerBackend`` (``palaestra.sandbox.docker``),
``RemoteBackend`` (an exec server over HTTP; ``ExecServer`` is that server). The remote client is
imported on first use, so that the server and the local backend need nothing beyond the standard
library (the exec server's image is built offline from a system python).
"""

from palaestra.sandbox.backends import get_backend
from palaestra.sandbox.base import Backend, ExecResult, Limits, Sandbox, SandboxError, Status
from palaestra.sandbox.local import LocalBackend
from palaestra.sandbox.output import CappedOutput
from palaestra.sandbox.pool import SandboxPool
from palaestra.sandbox.server import ExecServer

__all__ = [
    "Backend",
    "CappedOutput",
    "ExecResult",
    "ExecServer",
    "Limits",
    "LocalBackend",
    "RemoteBackend",
    "Sandbox",
    "SandboxError",
    "SandboxPool",
    "Status",
    "get_backend",
]


def __getattr__(name: str):
    if name == "RemoteBackend":  # needs httpx
        from palaestra.sandbox.remote import RemoteBackend

        return RemoteBackend
    raise AttributeError(f"module 'palaestra.sandbox' has no attribute {name!r}")
