"""The exec server: sandboxes of one backend, over HTTP, behind an API key.

    palaestra sandbox serve --port 8100 --api-key KEY            # wraps the local backend
    RemoteBackend("http://127.0.0.1:8100", api_key="KEY")          # the client (remote.py)

Standard library only (an asyncio HTTP/1.1 server with keep-alive), so that it runs from the
host's system python inside an image built offline. Every route but ``/health`` needs
``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``); a missing or wrong key answers 401.
Requests and answers are JSON except file bodies, which are raw bytes:

    GET    /health                              {"ok", "backend", "sandboxes"}
    POST   /v1/sandboxes                        {"profile", "limits", "label", "owner"} → {"id", "limits"}
    GET    /v1/sandboxes                        [{"id", "label", "owner", "idle_s"}]
    POST   /v1/sandboxes/ID/exec                {"cmd" | "script", "stdin", "timeout"} → ExecResult
    PUT    /v1/sandboxes/ID/files?path=P        body: the file → 204
    GET    /v1/sandboxes/ID/files?path=P        → the file (404 if missing)
    GET    /v1/sandboxes/ID/alive               {"alive"}
    POST   /v1/sandboxes/ID/reset               {"ok"}
    DELETE /v1/sandboxes/ID                     204 (also for an unknown ID: closing is idempotent)
    POST   /v1/cleanup                          {"label", "owner", "idle_s"} → {"removed"}

Bad input answers 400 with an ``error`` naming the field; a broken sandbox answers 500 with
``"type": "SandboxError"``; the server keeps serving. Sandboxes idle for ``idle_timeout_s`` are
closed (their client is presumed gone), and at start-up the server removes what a crashed earlier
server left behind (``Backend.cleanup_leaked``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from palaestra.sandbox.base import Backend, Limits, Sandbox, SandboxError

__all__ = ["ExecServer"]

log = logging.getLogger("palaestra.sandbox.server")

MAX_HEADER_LINE = 16 << 10
MAX_HEADERS = 100
EXEC_FIELDS = {"cmd", "script", "stdin", "stdin_b64", "timeout"}
CREATE_FIELDS = {"profile", "limits", "label", "owner"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass
class _Entry:
    sandbox: Sandbox
    label: str
    owner: str
    last_used: float = field(default_factory=time.monotonic)


Response = tuple[int, bytes, str]  # status, body, content type


class ExecServer:
    """Serves one backend's sandboxes. Run with ``await server.start(host, port)`` then
    ``await server.serve_forever()``; ``close()`` closes every sandbox it made."""

    def __init__(
        self,
        backend: Backend,
        api_key: str,
        *,
        max_sandboxes: int = 64,
        idle_timeout_s: float = 900.0,
        max_body_bytes: int = 256 << 20,
    ) -> None:
        if not api_key:
            raise ValueError("the exec server needs an API key ('api_key' is empty)")
        self.backend = backend
        self.api_key = api_key
        self.max_sandboxes = max_sandboxes
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes
        self.sandboxes: dict[str, _Entry] = {}
        self._server: asyncio.Server | None = None
        self._reaper: asyncio.Task | None = None

    async def start(
        self, host: str = "127.0.0.1", port: int = 8100, *, uds: str | None = None
    ) -> tuple[str, int]:
        """Listen on host:port, or on the unix socket ``uds`` (how the compose fleet's replicas,
        which have no network, are reached); returns the bound (host, port), or (uds, 0)."""
        removed = await self.backend.cleanup_leaked()
        if removed:
            log.info("removed %d sandboxes leaked by an earlier server", removed)
        if uds:
            with contextlib.suppress(FileNotFoundError):  # left by a replica that was killed
                os.unlink(uds)
            self._server = await asyncio.start_unix_server(self._connection, uds, limit=MAX_HEADER_LINE)
            os.chmod(uds, 0o600)
        else:
            self._server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEADER_LINE)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())
        if uds:
            return uds, 0
        return self._server.sockets[0].getsockname()[:2]

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
        entries = list(self.sandboxes.values())
        self.sandboxes.clear()
        await asyncio.gather(*(e.sandbox.close() for e in entries), return_exceptions=True)
        await self.backend.close()

    # -- HTTP/1.1 --------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if (
            sock is not None and sock.family != socket.AF_UNIX
        ):  # small answers must not wait for a delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    return
                method, target, headers, body, keep_alive = request
                status, payload, ctype = await self._respond(method, target, headers, body)
                head = (
                    f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                    f"Content-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n"
                    f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
                )
                writer.write(head.encode("latin-1") + payload)
                await writer.drain()
                if not keep_alive:
                    return
        except _Malformed as exc:
            payload = json.dumps({"error": str(exc)}).encode()
            writer.write(
                f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader):
        try:
            line = await reader.readline()
        except ValueError:  # longer than the stream's limit
            raise _Malformed(431, "request line too long") from None
        if not line:
            return None
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Malformed(400, "malformed request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            try:
                raw = await reader.readline()
            except ValueError:
                raise _Malformed(431, "header line too long") from None
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep:
                raise _Malformed(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        else:
            raise _Malformed(431, f"more than {MAX_HEADERS} headers")
        if "transfer-encoding" in headers:
            raise _Malformed(411, "send a Content-Length; chunked bodies are not supported")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise _Malformed(400, "'Content-Length' must be an integer") from None
        if length < 0 or length > self.max_body_bytes:
            raise _Malformed(413, f"body must be at most {self.max_body_bytes} bytes; got {length}")
        body = await reader.readexactly(length) if length else b""
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return method, target, headers, body, keep_alive

    async def _respond(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Response:
        url = urlsplit(target)
        try:
            if url.path == "/health" and method == "GET":
                return _json(
                    200, {"ok": True, "backend": self.backend.name, "sandboxes": len(self.sandboxes)}
                )
            if not self._authorized(headers):
                raise HTTPError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")
            return await self._route(method, url.path, parse_qs(url.query), body)
        except HTTPError as exc:
            return _json(exc.status, {"error": str(exc), "type": exc.kind})
        except FileNotFoundError as exc:
            return _json(404, {"error": str(exc), "type": "FileNotFoundError"})
        except ValueError as exc:
            return _json(400, {"error": str(exc), "type": "ValueError"})
        except OSError as exc:
            return _json(400, {"error": str(exc), "type": "OSError", "errno": exc.errno})
        except SandboxError as exc:
            return _json(500, {"error": str(exc), "type": "SandboxError"})
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("internal error on %s %s", method, url.path)
            return _json(500, {"error": f"internal error: {type(exc).__name__}: {exc}", "type": "internal"})

    def _authorized(self, headers: dict[str, str]) -> bool:
        given = headers.get("x-api-key", "")
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    # -- routes ------------------------------------------------------------------------------------

    async def _route(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> Response:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] != ["v1", "sandboxes"] and parts != ["v1", "cleanup"]:
            raise HTTPError(404, f"no route {path}")
        if parts == ["v1", "cleanup"]:
            _allow(method, "POST")
            return _json(200, {"removed": await self._cleanup(_object(body))})
        if len(parts) == 2:
            _allow(method, "GET", "POST")
            if method == "GET":
                now = time.monotonic()
                listing = [
                    {"id": sid, "label": e.label, "owner": e.owner, "idle_s": now - e.last_used}
                    for sid, e in self.sandboxes.items()
                ]
                return _json(200, listing)
            return await self._create(_object(body))
        entry = self.sandboxes.get(parts[2])
        action = parts[3] if len(parts) > 3 else ""
        if len(parts) > 4 or action not in ("", "exec", "files", "alive", "reset"):
            raise HTTPError(404, f"no route {path}")
        if action == "" and method == "DELETE":
            if entry is not None:
                self.sandboxes.pop(parts[2], None)
                await entry.sandbox.close()
            return 204, b"", "application/json"
        if entry is None:
            raise HTTPError(404, f"no sandbox {parts[2]!r}", "NotFound")
        entry.last_used = time.monotonic()
        box = entry.sandbox
        if action == "exec":
            _allow(method, "POST")
            result = await box.exec(**_exec_args(_object(body)))
            entry.last_used = time.monotonic()
            return _json(200, result.to_dict())
        if action == "files":
            _allow(method, "GET", "PUT")
            file_path = (query.get("path") or [""])[0]
            if not file_path:
                raise ValueError("query parameter 'path' is required")
            if method == "PUT":
                await box.upload(file_path, body)
                return 204, b"", "application/json"
            return 200, await box.download(file_path), "application/octet-stream"
        if action == "alive":
            _allow(method, "GET")
            return _json(200, {"alive": await box.alive()})
        if action == "reset":
            _allow(method, "POST")
            await box.reset()
            return _json(200, {"ok": True})
        raise HTTPError(405, f"{method} not allowed on {path}")

    async def _create(self, req: dict[str, Any]) -> Response:
        unknown = sorted(set(req) - CREATE_FIELDS)
        if unknown:
            raise ValueError(f"unknown fields {unknown}; known: {sorted(CREATE_FIELDS)}")
        if len(self.sandboxes) >= self.max_sandboxes:
            raise HTTPError(503, f"this server holds its maximum of {self.max_sandboxes} sandboxes", "Full")
        limits = req.get("limits") or {}
        if not isinstance(limits, dict):
            raise ValueError(f"'limits' must be an object; got {limits!r}")
        label, owner = req.get("label", ""), req.get("owner", "")
        if not isinstance(label, str) or not isinstance(owner, str):
            raise ValueError("'label' and 'owner' must be strings")
        box = await self.backend.create(req.get("profile", "python"), Limits.from_dict(limits))
        self.sandboxes[box.id] = _Entry(box, label, owner)
        return _json(201, {"id": box.id, "limits": box.limits.to_dict()})

    async def _cleanup(self, req: dict[str, Any]) -> int:
        """Close sandboxes with ``label`` held by another ``owner`` and idle for ``idle_s``."""
        label, owner = req.get("label"), req.get("owner", "")
        idle_s = req.get("idle_s", 300.0)
        if not isinstance(label, str) or not label:
            raise ValueError("'label' must be a non-empty string")
        if isinstance(idle_s, bool) or not isinstance(idle_s, int | float) or idle_s < 0:
            raise ValueError(f"'idle_s' must be a number >= 0; got {idle_s!r}")
        now = time.monotonic()
        stale = [
            sid
            for sid, e in self.sandboxes.items()
            if e.label == label and e.owner != owner and now - e.last_used >= idle_s
        ]
        await self._close_ids(stale)
        return len(stale)

    async def _close_ids(self, ids: list[str]) -> None:
        entries = [self.sandboxes.pop(sid) for sid in ids if sid in self.sandboxes]
        await asyncio.gather(*(e.sandbox.close() for e in entries), return_exceptions=True)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.idle_timeout_s / 4))
            now = time.monotonic()
            idle = [sid for sid, e in self.sandboxes.items() if now - e.last_used > self.idle_timeout_s]
            if idle:
                log.info("closing %d sandboxes idle for more than %g s", len(idle), self.idle_timeout_s)
                await self._close_ids(idle)


class _Malformed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(status: int, data: Any) -> Response:
    return status, json.dumps(data).encode(), "application/json"


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise HTTPError(405, f"method {method} not allowed here; use {' or '.join(allowed)}")


def _object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    return data


def _exec_args(req: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(req) - EXEC_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; known: {sorted(EXEC_FIELDS)}")
    stdin: bytes | str | None = req.get("stdin")
    if "stdin_b64" in req:
        try:
            stdin = base64.b64decode(req["stdin_b64"], validate=True)
        except (ValueError, TypeError):
            raise ValueError("'stdin_b64' must be base64") from None
    if stdin is not None and not isinstance(stdin, str | bytes):
        raise ValueError(f"'stdin' must be a string; got {type(stdin).__name__}")
    timeout = req.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise ValueError(f"'timeout' must be a number of seconds; got {timeout!r}")
    return {"cmd": req.get("cmd"), "script": req.get("script"), "stdin": stdin, "timeout": timeout}
