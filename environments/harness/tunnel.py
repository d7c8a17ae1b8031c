"""The one way out of a harness sandbox: a unix socket that reaches exactly one session's routes.

A harness sandbox has no network. `SessionTunnel` listens on a unix socket (bound into the sandbox,
where a forwarder inside the sandbox's own network namespace exposes it as a loopback port for the
harness's base URL) and forwards to the gateway only requests whose path is under that session's
`/s/<id>/v1/`: the other sessions' routes, the session and admin API, `/metrics` and any other
destination are refused with a 403 naming what is allowed, and counted (`refused`). The path is
checked after normalisation (`..`, `//`, percent-escapes), so no spelling reaches another route.
Answers, streamed ones too, are passed through as they arrive.

With `max_calls`, the tunnel is also the episode's turn budget: the model calls (POSTs) past it are
answered 429 without reaching the gateway, counted (`over_budget`), and `spent` is set, which the
harness environment turns into stopping the harness (`failure/harness_timeout`).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections import Counter
from urllib.parse import unquote

import aiohttp
from aiohttp import web

__all__ = ["SessionTunnel"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization", "host"}


class SessionTunnel:
    """Forwards `/s/<session_id>/v1/...` on the unix socket `path` to `gateway_url`; refuses the rest."""

    def __init__(self, gateway_url: str, session_id: str, path: str, max_calls: int | None = None):
        self.gateway_url = gateway_url.rstrip("/")
        self.prefix = f"/s/{session_id}/v1/"
        self.path = path
        self.max_calls = max_calls
        """Model calls (POSTs) forwarded at most; None: no budget."""
        self.refused: Counter[str] = Counter()
        """Refused requests by the path they asked for (first 200 characters)."""
        self.forwarded = 0
        self.calls = 0
        """POSTs forwarded (the harness's model calls)."""
        self.over_budget = 0
        self.hung_up = 0
        """Answers the harness closed its connection on before they were all written."""
        self.unreachable = 0
        """Requests answered 502 because the gateway could not be reached."""
        self.spent = asyncio.Event()
        """Set when a call past `max_calls` was refused."""
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    def allows(self, raw_path: str) -> bool:
        path = unquote(raw_path.split("?", 1)[0])
        normal = posixpath.normpath(path) + ("/" if path.endswith("/") else "")
        return path == normal and normal.startswith(self.prefix) and "\\" not in path

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path
        if not self.allows(raw):
            self.refused[raw[:200]] += 1
            return web.json_response(
                {"error": {"message": f"this tunnel reaches only {self.prefix}*", "type": "forbidden"}},
                status=403,
            )
        if request.method == "POST":
            if self.max_calls is not None and self.calls >= self.max_calls:
                self.over_budget += 1
                self.spent.set()
                return web.json_response(
                    {
                        "error": {
                            "message": f"the episode's budget of {self.max_calls} model calls is spent",
                            "type": "budget_exhausted",
                        }
                    },
                    status=429,
                )
            self.calls += 1
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            return await self._forward(request, raw, headers)
        except aiohttp.ClientConnectorError as exc:
            # The gateway went away: the harness gets a 502 it can report, the episode's own
            # gateway call fails with one line; no aiohttp "Error handling request" traceback.
            self.unreachable += 1
            return web.json_response(
                {
                    "error": {
                        "message": f"gateway unreachable at {self.gateway_url}: {type(exc).__name__}",
                        "type": "gateway_unreachable",
                    }
                },
                status=502,
            )

    async def _forward(self, request: web.Request, raw: str, headers: dict[str, str]) -> web.StreamResponse:
        assert self._client is not None
        async with self._client.request(
            request.method,
            self.gateway_url + raw,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as upstream:
            out = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    out.headers[k] = v
            self.forwarded += 1
            try:
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionError:  # the harness hung up first (it had what it wanted): not an error
                self.hung_up += 1
            return out

    async def start(self) -> None:
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.path).start()
        os.chmod(self.path, 0o666)  # a sandbox's user (another uid) connects to it

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()
