"""``get_backend(spec)``: a backend from the name users type (CLI ``--backend``, configs).

    get_backend("local")                        # bubblewrap on this machine
    get_backend("docker")                       # containers on the local Docker engine
    get_backend("http://127.0.0.1:8100")        # an exec server (api_key or $PALAESTRA_SANDBOX_API_KEY)

Backends are imported on demand, so choosing one never needs another's dependencies.
"""

from __future__ import annotations

from palaestra.sandbox.base import Backend

__all__ = ["BACKEND_NAMES", "get_backend"]

BACKEND_NAMES = ("local", "docker")
"""The backends named by a word; a third kind is named by its URL (an exec server)."""


def get_backend(spec: str = "local", *, api_key: str | None = None, label: str | None = None) -> Backend:
    """The backend ``spec`` names: "local", "docker", or an http(s) URL of an exec server."""
    kw = {"label": label} if label else {}
    if spec == "local":
        from palaestra.sandbox.local import LocalBackend

        return LocalBackend(**kw)
    if spec == "docker":
        from palaestra.sandbox.docker import DockerBackend

        return DockerBackend(**kw)
    if spec.startswith(("http://", "https://")):
        from palaestra.sandbox.remote import RemoteBackend

        return RemoteBackend(url=spec, api_key=api_key, **kw)
    names = ", ".join(repr(name) for name in BACKEND_NAMES)
    raise ValueError(f"backend must be {names} or an http(s) URL of an exec server; got {spec!r}")
