"""The compose fleet's front: one HTTP address on the host's loopback for N exec-server replicas
that have no network at all and listen on unix sockets in a shared directory.

    python -m palaestra.sandbox.front --listen 127.0.0.1:8790 --sockets /run/palaestra

Why it exists: the replicas run with ``network_mode: none`` (the code they run must not see any
interface but loopback), so the host reaches them only through their sockets; and a sandbox lives
in one replica, so every request about it must reach the replica that created it. The front:

* finds replicas as ``*.sock`` files in ``--sockets`` (rescanned every few seconds; a replica that
  refuses connections is skipped until it answers again);
* sends ``POST /sandboxes`` to the replica with the fewest sandboxes it knows of, and remembers
  which replica the returned ``id`` lives in;
* forwards ``/sandboxes/{id}/...`` to that replica, and forgets the id once its DELETE succeeds;
* answers ``GET /health`` itself (live replicas, sandboxes) and forwards anything else to a live
  replica. The API key is checked by the replicas; the front passes ``Authorization`` through.

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
            body = {
                "status": "ok" if live else "no replicas",
                "replicas": len(live),
                "sandboxes": len(self.owner),
            }
            return web.json_response(body, status=200 if live else 503)
        body = await request.read()
        parts = request.path.strip("/").split("/")
        if parts[0] == "sandboxes" and len(parts) == 1 and request.method == "POST":
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
        if parts[0] == "sandboxes" and len(parts) >= 2:
            replica = self.owner.get(parts[1])
            if replica is None:
                return web.json_response({"error": f"unknown sandbox {parts[1]!r}"}, status=404)
            _, (status, headers, data) = await self._try([replica], request, body)
            if request.method == "DELETE" and len(parts) == 2 and (status < 300 or status == 404):
                replica.sandboxes.discard(parts[1])
                self.owner.pop(parts[1], None)
            return web.Response(status=status, headers=headers, body=data)
        _, (status, headers, data) = await self._try(self.live(), request, body)
        return web.Response(status=status, headers=headers, body=data)

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
    web.run_app(Front(args.sockets, args.timeout).app(), host=host or "127.0.0.1", port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
