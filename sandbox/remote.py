"""The remote backend: the sandbox interface over HTTP to an exec server (``server.py``).

    backend = RemoteBackend("http://sandboxes:8100", api_key=os.environ["PALAESTRA_SANDBOX_API_KEY"])
    box = await backend.create("python", Limits(memory_mb=256))
    result = await box.exec(["python3", "-c", "print(1)"])

What isolates the code is whatever backend the server wraps (bubblewrap on a host, a container in
compose); this module only moves requests. Every request carries the API key. Connection failures
and broken sandboxes raise ``SandboxError``; a missing file raises ``FileNotFoundError``; bad input
is rejected by the server with a message naming the field, raised here as ``ValueError``.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx

from palaestra.sandbox.base import Backend, ExecResult, Limits, Mount, Sandbox, SandboxError, work_path

__all__ = ["RemoteBackend", "RemoteSandbox"]

API_KEY_ENV = "PALAESTRA_SANDBOX_API_KEY"
REQUEST_SLACK_S = 30.0
"""How much longer than an exec's own timeout the client waits for its answer."""


@dataclass
class RemoteBackend(Backend):
    """Sandboxes held by an exec server at ``url``."""

    url: str = ""
    api_key: str | None = None
    """The server's key (default: ``$PALAESTRA_SANDBOX_API_KEY``)."""
    owner: str = ""
    """Who holds this backend's sandboxes on the server (default: host, pid and a random token)."""
    leak_after_s: float = 300.0
    """``cleanup_leaked`` removes sandboxes with this label held by other owners and idle this long."""

    name = "remote"
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"'url' must be an http(s) URL of an exec server; got {self.url!r}")
        self.url = self.url.rstrip("/")
        self.api_key = self.api_key or os.environ.get(API_KEY_ENV)
        if not self.api_key:
            raise ValueError(f"the exec server needs an API key: pass api_key or set {API_KEY_ENV}")
        self.owner = self.owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

    @property
    def client(self) -> httpx.AsyncClient:
        # Made on first use, inside the event loop that uses it.
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=httpx.Timeout(60.0, connect=10.0),
                trust_env=False,
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._client

    async def request(
        self, method: str, path: str, *, timeout: float | None = None, **kw: Any
    ) -> httpx.Response:
        """One request; raises the exception the answer stands for."""
        try:
            response = await self.client.request(
                method, path, timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT, **kw
            )
        except httpx.HTTPError as exc:
            raise SandboxError(f"exec server {self.url} unreachable: {type(exc).__name__}: {exc}") from None
        if response.is_success:
            return response
        try:
            body = response.json()
            message, kind = body.get("error", response.text), body.get("type", "")
        except ValueError:
            message, kind = response.text[:500], ""
        if response.status_code == 401:
            raise SandboxError(f"exec server {self.url} refused the API key: {message}")
        if kind == "FileNotFoundError":
            raise FileNotFoundError(message)
        if kind == "OSError":
            raise OSError(body.get("errno") or 0, message)
        if response.status_code == 400:
            raise ValueError(message)
        raise SandboxError(f"exec server {self.url}: HTTP {response.status_code}: {message}")

    async def create(
        self, profile: str = "python", limits: Limits | None = None, mounts: tuple[Mount, ...] = ()
    ) -> RemoteSandbox:
        if mounts:
            raise SandboxError(
                "the remote backend cannot mount host paths into a sandbox (they are on another "
                "machine): use the local or docker backend"
            )
        limits = limits or Limits()
        response = await self.request(
            "POST",
            "/v1/sandboxes",
            json={"profile": profile, "limits": limits.to_dict(), "label": self.label, "owner": self.owner},
            timeout=120.0,
        )
        data = response.json()
        return RemoteSandbox(self, data["id"], Limits.from_dict(data["limits"]))

    async def cleanup_leaked(self) -> int:
        response = await self.request(
            "POST",
            "/v1/cleanup",
            json={"label": self.label, "owner": self.owner, "idle_s": self.leak_after_s},
        )
        return int(response.json()["removed"])

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class RemoteSandbox(Sandbox):
    """A sandbox held by an exec server."""

    def __init__(self, backend: RemoteBackend, sid: str, limits: Limits) -> None:
        self.backend = backend
        self.id = sid
        self.limits = limits
        self._closed = False

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{self.id}"

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def exec(
        self,
        cmd: str | list[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        self._check_open()
        body: dict[str, Any] = {"cmd": cmd, "script": script, "timeout": timeout}
        if isinstance(stdin, bytes):
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        elif stdin is not None:
            body["stdin"] = stdin
        wait = (timeout if timeout is not None else self.limits.timeout_s) + REQUEST_SLACK_S
        response = await self.backend.request("POST", f"{self._path}/exec", json=body, timeout=wait)
        return ExecResult.from_dict(response.json())

    async def upload(self, path: str, data: bytes | str) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self.backend.request(
            "PUT", f"{self._path}/files", params={"path": work_path(path)}, content=payload
        )

    async def download(self, path: str) -> bytes:
        self._check_open()
        response = await self.backend.request("GET", f"{self._path}/files", params={"path": work_path(path)})
        return response.content

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            response = await self.backend.request("GET", f"{self._path}/alive", timeout=10.0)
        except SandboxError:
            return False
        return bool(response.json().get("alive"))

    async def reset(self) -> None:
        self._check_open()
        await self.backend.request("POST", f"{self._path}/reset")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.backend.request("DELETE", self._path)
