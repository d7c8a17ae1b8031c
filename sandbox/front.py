"""The compose fleet's front: one HTTP address on the host's loopback for N exec-server replicas
that have no network at all and listen on unix sockets in a shared directory.

    python -m palaestra.sandbox.front --listen 127.0.0.1:8790 --sockets /run/palaestra

Why it exists: the replicas run with ``network_mode: none`` (the code they run must not see any
interface but loopback), so the host reaches them only through their sockets; and a sandbox lives
in one replica, so every request about it must reach the replica that created it. The front:

* finds replicas as ``*.sock`` files in ``--sockets`` (rescanned every few seconds; a replica that
  refuses connections is skipped until it answers again);
* sends ``POST /v1/sandboxes`` to the replica with the fewest sandboxes it knows of, and remembers
  which replica the returned ``id`` lives in;
* forwards ``/v1/sandboxes/{id}/...`` to that replica, and forgets the id once it is deleted (or
  the replica says it has no such sandbox);
* asks every replica for ``GET /v1/sandboxes`` and ``POST /v1/cleanup`` and merges the answers;
* answers ``GET /health`` itself (live replicas, sandboxes) and forwards anything else to a live
  replica. The API key is checked by the replicas (the front passes ``Authorization`` through),
  so the front never answers anything but /health without a replica's say.

It holds no state a restart cannot lose: sandboxes whose front forgot them are reaped by their
replica's idle timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

__all__ = ["Front", "main"]

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "upgrade"}
RESCAN_S = 2.0


@dataclass
class Replica:
    path: str
    session: aiohttp.ClientSession
    sandboxes: set[str] = field(default_factory=set)
    down_until: float = 0.0


class Front:
    """The routing table and the forwarding; ``app()`` is the aiohttp application."""

    def __init__(self, sockets_dir: str, timeout_s: float = 600.0) -> None:
        self.sockets_dir = sockets_dir
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.replicas: dict[str, Replica] = {}
        self.owner: dict[str, Replica] = {}
        self._scanned = 0.0

    def _rescan(self) -> None:
        if time.monotonic() - self._scanned < RESCAN_S:
            return
        self._scanned = time.monotonic()
        found = set(glob.glob(os.path.join(self.sockets_dir, "*.sock")))
        for path in found - set(self.replicas):
            connector = aiohttp.UnixConnector(path=path)
            self.replicas[path] = Replica(
                path, aiohttp.ClientSession(connector=connector, timeout=self.timeout)
            )
        for path in set(self.replicas) - found:
            gone = self.replicas.pop(path)
            for sid in gone.sandboxes:
                self.owner.pop(sid, None)
            asyncio.get_running_loop().create_task(gone.session.close())

    def live(self) -> list[Replica]:
        self._rescan()
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.down_until <= now]

    async def _forward(self, replica: Replica, request: web.Request, body: bytes) -> tuple[int, dict, bytes]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with replica.session.request(
            request.method, f"http://replica{request.rel_url}", headers=headers, data=body or None
        ) as resp:
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            return resp.status, out_headers, await resp.read()

    async def _try(self, replicas: list[Replica], request: web.Request, body: bytes) -> tuple[Replica, tuple]:
        """Forward to the first replica that accepts the connection; one that refuses is skipped
        for a few seconds (it may be restarting)."""
        for replica in replicas:
            try:
                return replica, await self._forward(replica, request, body)
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, FileNotFoundError):
                replica.down_until = time.monotonic() + RESCAN_S
        raise web.HTTPServiceUnavailable(
            text=json.dumps({"error": "no exec-server replica answers"}), content_type="application/json"
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health" and request.method == "GET":
            live = self.live()
            body = {"ok": bool(live), "replicas": len(live), "sandboxes": len(self.owner)}
            return web.json_response(body, status=200 if live else 503)
        body = await request.read()
        parts = request.path.strip("/").split("/")
        if parts[:2] == ["v1", "sandboxes"] and len(parts) == 2 and request.method == "POST":
            return await self._create(request, body)
        if parts[:2] == ["v1", "sandboxes"] and len(parts) >= 3:
            return await self._sandbox(parts[2], len(parts) == 3, request, body)
        if (parts == ["v1", "sandboxes"] and request.method == "GET") or parts == ["v1", "cleanup"]:
            return await self._everywhere(parts[1], request, body)
        _, (status, headers, data) = await self._try(self.live(), request, body)
        return web.Response(status=status, headers=headers, body=data)

    async def _create(self, request: web.Request, body: bytes) -> web.Response:
        candidates = sorted(self.live(), key=lambda r: len(r.sandboxes))
        replica, (status, headers, data) = await self._try(candidates, request, body)
        if status < 300:
            try:
                sid = json.loads(data)["id"]
            except (ValueError, KeyError, TypeError):
                sid = None
            if isinstance(sid, str):
                replica.sandboxes.add(sid)
                self.owner[sid] = replica
        return web.Response(status=status, headers=headers, body=data)

    async def _sandbox(self, sid: str, whole: bool, request: web.Request, body: bytes) -> web.Response:
        replica = self.owner.get(sid)
        if replica is None:
            return web.json_response({"error": f"no sandbox {sid!r}", "type": "NotFound"}, status=404)
        _, (status, headers, data) = await self._try([replica], request, body)
        gone = status == 404 and b'"NotFound"' in data  # the replica closed it (idle) or restarted
        if gone or (request.method == "DELETE" and whole and status < 300):
            replica.sandboxes.discard(sid)
            self.owner.pop(sid, None)
        return web.Response(status=status, headers=headers, body=data)

    async def _everywhere(self, what: str, request: web.Request, body: bytes) -> web.Response:
        """List or clean up on every live replica and merge the answers."""
        live = self.live()
        if not live:
            return web.json_response({"error": "no exec-server replica answers"}, status=503)
        answers = await asyncio.gather(
            *(self._forward(r, request, body) for r in live), return_exceptions=True
        )
        merged: list | int = [] if what == "sandboxes" else 0
        for answer in answers:
            if isinstance(answer, BaseException):
                continue
            status, _, data = answer
            if status >= 300:
                return web.Response(status=status, body=data, content_type="application/json")
            if what == "sandboxes":
                merged += json.loads(data)
            else:
                merged += int(json.loads(data)["removed"])
        return web.json_response(merged if what == "sandboxes" else {"removed": merged})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)

        async def close_sessions(_: web.Application) -> None:
            for replica in self.replicas.values():
                await replica.session.close()

        app.on_cleanup.append(close_sessions)
        return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Front for the compose fleet's exec-server replicas.")
    parser.add_argument(
        "--listen", default="127.0.0.1:8790", help="HOST:PORT to serve on (loopback by default)"
    )
    parser.add_argument("--sockets", required=True, help="directory holding the replicas' *.sock files")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request limit towards a replica, s")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    print(f"palaestra sandbox front: http://{host}:{port} -> {args.sockets}/*.sock", flush=True)
    web.run_app(Front(args.sockets, args.timeout).app(), host=host or "127.0.0.1", port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
