"""More than one gateway process: each session owned by one shard, a front that forwards to it.

    palaestra gateway serve ... --port 8101 --spool-dir runs/spool/shard-0     # shard 0
    palaestra gateway serve ... --port 8102 --spool-dir runs/spool/shard-1     # shard 1
    palaestra gateway front --shard-url http://127.0.0.1:8101 --shard-url http://127.0.0.1:8102 --port 8000

A session is owned by shard `shard_of(session_id, n)`: a hash of the session id, the same key the
gateway sends the router (X-SMG-Routing-Key), stable across processes and hosts. Each shard is a
whole gateway (`app.create_app`) with its own spool and session journal, so a shard that dies is
today's gateway death: restarted on its port and spool directory it replays its journal and its
sessions continue on exact tokens.

The front (`Front`) knows no dialect (but for its own errors: Anthropic's envelope on Anthropic's
routes) and holds no key; per request it reads the path, and for a new session the body, and
forwards the bytes both ways unchanged (SSE streams chunk by chunk, the shard checks the
credentials):

* ``/s/<id>/...``, ``/sessions/<id>...`` go to the id's shard; ``POST /sessions`` to the shard of
  the body's ``session_id``, which the front picks (a uuid4, as a single gateway would) when the
  body names none; ``/v1/...`` to the shard of its ``X-Session-ID`` header;
* ``/samples``, ``/samples/ack``, ``/samples/stream`` name their shard (``?shard=<i>``): spool
  cursors are per shard, so the trainer reads and acknowledges each shard on its own
  (`orchestrator.batching.SampleFeed`);
* ``/admin/pause`` and ``/admin/resume`` go to every shard (in-flight counts summed, drained when
  all are), ``/admin/routing`` answers each shard's snapshot, ``/metrics`` every shard's series with
  a ``shard`` label, ``/health`` ok once every shard answers.

Why a front rather than shards sharing one port (SO_REUSEPORT): the kernel hands each connection to
any of the processes, so a shard would forward most calls of a session it does not own to the one
that does, and an agent's keep-alive connection would carry calls of one session to a random
process; a front decides once per request, costs one local hop (docs/gateway.md has the measured
cost) and shards may be on other hosts (their URLs are the front's only configuration).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from palaestra.gateway.event_loop import new_event_loop
from palaestra.net import ServerProcess, free_port

__all__ = ["Front", "GatewayFleet", "front_app", "front_process", "shard_of", "shard_spool"]

SESSION_HEADER = "x-session-id"
# Headers of one hop (RFC 9110 section 7.6.1): never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
# Not forwarded to a shard: the body's length is the forwarded body's (aiohttp sends it).
_NOT_SENT = _HOP | {"content-length"}
# Not forwarded back: the front's server writes its own length, date and name.
_NOT_RETURNED = _HOP | {"content-length", "date", "server"}
# An answer up to this length is read whole and written back in one write; a longer one (a page of
# samples, a long trajectory) streams through, so the front never holds more than this of one answer.
_WHOLE_MAX = 1 << 20
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?( .*)$")


def shard_of(session_id: str, shards: int) -> int:
    """The shard that owns `session_id`: blake2b of the id modulo `shards` (Python's `hash` is
    salted per process, so it cannot be shared by a front and its shards)."""
    if shards <= 1:
        return 0
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_spool(spool_dir: str, index: int, shards: int) -> str:
    """Shard `index`'s spool and journal directory: `spool_dir` itself with one shard, else
    `spool_dir/shard-<index>`."""
    return spool_dir if shards <= 1 else f"{spool_dir.rstrip('/')}/shard-{index}"


def _anthropic_route(path: str) -> bool:
    """Anthropic's Messages routes (`/s/<id>/v1/messages`, `/v1/messages`, their `/count_tokens`):
    their clients read Anthropic's error envelope, not OpenAI's."""
    return path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens")


def _error(status: int, message: str, path: str = "", **headers: str) -> web.Response:
    """The front's own error, in the envelope of the route's dialect (as a shard would answer it):
    Anthropic's `{"type": "error", "error": {type, message}}` on its routes, else OpenAI's."""
    if _anthropic_route(path):
        kind = "api_error" if status >= 500 else "invalid_request_error"  # the gateway's own mapping
        body: dict = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": "gateway_front", "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Front:
    """Forwards each request to the shard that owns its session (the module docstring)."""

    def __init__(self, shard_urls: Sequence[str]):
        if not shard_urls:
            raise ValueError("a front needs at least one shard URL (--shard-url)")
        self.urls = [u.rstrip("/") for u in shard_urls]
        self.http: aiohttp.ClientSession | None = None

    @property
    def n(self) -> int:
        return len(self.urls)

    async def start(self, _app: web.Application | None = None) -> None:
        # No total timeout: a generation or a sample stream lasts as long as it lasts (the shards
        # time their engine calls); no connection limit: the shards' admission limits decide. Idle
        # connections are dropped after 2 s, before a shard (uvicorn) closes them at 5 s, so a call
        # is never sent on a connection the shard is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        self.http = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),  # a shard's cookie is its client's, not every client's
        )

    async def close(self, _app: web.Application | None = None) -> None:
        if self.http is not None:
            await self.http.close()

    # -- which shard -------------------------------------------------------------------------------
    def owner(self, path: str, headers: Mapping[str, str] | None = None) -> int | None:
        """The shard of a session's route, None for a route that is not a session's (`headers`: the
        request's, case-insensitive, as aiohttp gives them, or lower-cased names)."""
        parts = path.split("/")
        if len(parts) > 2 and parts[1] in ("s", "sessions") and parts[2]:
            return shard_of(parts[2], self.n)
        if parts[1:2] == ["v1"]:
            sid = ((headers or {}).get(SESSION_HEADER) or "").strip()
            return shard_of(sid, self.n)  # no header: any shard answers the error
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        if path in ("/admin/pause", "/admin/resume") and method == "POST":
            return await self._pause_or_resume(request)
        if path == "/admin/routing":
            return await self._each(request, lambda answers: {"shards": answers})
        if path == "/metrics":
            return await self._metrics(request)
        if path == "/health":
            return await self._health(request)
        body = await request.read()
        if path.startswith("/samples"):
            shard = request.query.get("shard", "")
            if not (shard.isdigit() and int(shard) < self.n):
                return _error(
                    400,
                    f"the sample spool is per shard: add ?shard=<0..{self.n - 1}> to {path} "
                    f"(this front has {self.n} shards; got {shard or 'none'!r})",
                )
            return await self.forward(request, int(shard), body)
        if path == "/sessions" and method == "POST":
            return await self._create(request, body)
        owner = self.owner(path, request.headers)
        return await self.forward(request, owner or 0, body)

    async def _create(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """POST /sessions: the session id decides the shard, so the front picks one when the body
        names none (a body that is not a JSON object goes to shard 0, which answers the error)."""
        try:
            data = json.loads(body) if body.strip() else {}
        except ValueError:
            return await self.forward(request, 0, body)
        if not isinstance(data, dict):
            return await self.forward(request, 0, body)
        sid = data.get("session_id")
        if sid is None:
            data["session_id"] = sid = uuid.uuid4().hex
            body = json.dumps(data).encode()
        return await self.forward(request, shard_of(sid if isinstance(sid, str) else "", self.n), body)

    # -- one shard -------------------------------------------------------------------------------
    async def forward(self, request: web.Request, shard: int, body: bytes) -> web.StreamResponse:
        """The shard's answer to `request`: an answer of known length up to `_WHOLE_MAX` read whole
        and written back in one response (one write of headers and body), any other (SSE, a long
        page) streamed back chunk by chunk as the shard sends it. The request goes on a pooled
        keep-alive connection to the shard, its body with its length (`body` is already read), its
        headers but the hop's unchanged."""
        assert self.http is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _NOT_SENT)
        url = self.urls[shard] + request.rel_url.raw_path_qs
        try:
            upstream = await self.http.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except (aiohttp.ClientError, OSError) as exc:
            # the shard is down (its supervisor restarts it on the same port): clients retry a 503
            return _error(
                503,
                f"gateway shard {shard} ({self.urls[shard]}) is unreachable: {type(exc).__name__}; retry",
                request.path,
                **{"Retry-After": "1"},
            )
        out: web.StreamResponse | None = None
        try:
            back = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in _NOT_RETURNED)
            length = upstream.headers.get("Content-Length")
            if (
                length is not None
                and length.isdigit()
                and int(length) <= _WHOLE_MAX
                and request.method != "HEAD"
            ):
                answer = await upstream.read()
                return web.Response(status=upstream.status, reason=upstream.reason, body=answer, headers=back)
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=back)
            if length is not None:
                out.content_length = int(length)
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():  # SSE: each event as the shard sends it
                await out.write(chunk)
            await out.write_eof()
            return out
        except (aiohttp.ClientError, ConnectionResetError):
            # the shard died mid-answer, or the client went away: the other side sees its connection
            # closed, as with one gateway (a shard drops the engine request of a client gone)
            upstream.close()
            if request.transport is not None:
                request.transport.close()
            return out or web.StreamResponse(status=502)
        finally:
            upstream.release()

    # -- every shard -----------------------------------------------------------------------------
    async def _all(self, request: web.Request) -> list[tuple[int, bytes, str]]:
        """(status, body, content type) of `request` sent to every shard; 503 for a shard down."""
        assert self.http is not None
        body = await request.read()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != "content-length"
        }

        async def one(url: str) -> tuple[int, bytes, str]:
            assert self.http is not None
            try:
                async with self.http.request(
                    request.method, url + request.rel_url.raw_path_qs, headers=headers, data=body or None
                ) as r:
                    return r.status, await r.read(), r.headers.get("Content-Type", "")
            except (aiohttp.ClientError, OSError) as exc:
                return 503, json.dumps({"error": {"message": f"{url}: {type(exc).__name__}"}}).encode(), ""

        return await asyncio.gather(*(one(u) for u in self.urls))

    def _refused(self, answers: list[tuple[int, bytes, str]]) -> web.Response | None:
        """The first shard's refusal (an auth error, a shard down), answered as it came."""
        for status, body, ctype in answers:
            if status >= 300:
                return web.Response(status=status, body=body, content_type=ctype.split(";")[0] or None)
        return None

    async def _each(self, request: web.Request, combine) -> web.Response:
        answers = await self._all(request)
        return self._refused(answers) or web.json_response(combine([json.loads(b) for _, b, _ in answers]))

    async def _pause_or_resume(self, request: web.Request) -> web.Response:
        def combine(answers: list[dict]) -> dict:
            out = {
                "paused": answers[0]["paused"],
                "in_flight": sum(a["in_flight"] for a in answers),
                "shards": answers,
            }
            if "drained" in answers[0]:
                out["drained"] = all(a["drained"] for a in answers)
            return out

        return await self._each(request, combine)

    async def _health(self, request: web.Request) -> web.Response:
        answers = await self._all(request)
        down = [i for i, (status, _, _) in enumerate(answers) if status != 200]
        if down:
            return _error(503, f"gateway shards {down} of {self.n} are not answering /health")
        return web.json_response({"status": "ok", "shards": self.n})

    async def _metrics(self, request: web.Request) -> web.Response:
        answers = await self._all(request)
        refused = self._refused(answers)
        if refused is not None:
            return refused
        return web.Response(
            text=labelled_metrics([b.decode() for _, b, _ in answers]),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Gateway-Shards": str(self.n)},
        )


def labelled_metrics(texts: Sequence[str]) -> str:
    """Prometheus text of every shard as one exposition: each sample gains ``shard="<i>"``; each
    family's HELP and TYPE lines appear once, its samples of every shard below them."""
    families: dict[str, list[str]] = {}
    for i, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                family = parts[2] if len(parts) > 2 else family
                lines = families.setdefault(family, [])
                if i == 0:
                    lines.append(line)
                continue
            m = _SAMPLE_LINE.match(line)
            if not m:
                continue
            name, labels, rest = m.groups()
            inner = labels[1:-1] if labels else ""
            shard = f'shard="{i}"' + ("," + inner if inner else "")
            families.setdefault(family or name, []).append(f"{name}{{{shard}}}{rest}")
    return "\n".join(line for lines in families.values() for line in lines) + "\n"


def front_app(shard_urls: Sequence[str]) -> web.Application:
    front = Front(shard_urls)
    app = web.Application(client_max_size=0)  # bodies are the shards' to limit (--max-body-bytes)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.close)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    return app


def serve_front(shard_urls: Sequence[str], host: str, port: int, *, event_loop: str = "auto") -> None:
    print(f"palaestra gateway front: http://{host}:{port} -> shards {', '.join(shard_urls)}", flush=True)
    loop = new_event_loop(event_loop, "palaestra gateway front")  # gateway.event_loop, as the shards'
    web.run_app(front_app(shard_urls), host=host, port=port, print=None, access_log=None, loop=loop)


def front_process(
    shard_urls: Sequence[str],
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    startup_timeout: float = 60.0,
    event_loop: str = "auto",
) -> ServerProcess:
    """`palaestra gateway front` as a subprocess (tests, benches, `palaestra train`), on the shards'
    `gateway.event_loop`."""
    picked = ["--port"] if not port else []
    port = port or free_port()
    argv = [sys.executable, "-m", "palaestra.cli", "gateway", "front", "--host", host, "--port", str(port)]
    argv += ["--event-loop", event_loop]
    for url in shard_urls:
        argv += ["--shard-url", url]
    return ServerProcess(
        argv,
        f"http://127.0.0.1:{port}",
        name=f"gateway-front-{port}",
        startup_timeout=startup_timeout,
        free_ports=picked,
    )


def _event_loop(serve_args: Sequence[str]) -> str:
    """The `--event-loop` of `palaestra gateway serve` arguments (auto when they give none)."""
    args = list(serve_args)
    for i, arg in enumerate(args):
        if arg == "--event-loop" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--event-loop="):
            return arg.split("=", 1)[1]
    return "auto"


class GatewayFleet:
    """`shards` gateway processes (`gateway_process`, spools `shard_spool(spool_dir, i, shards)`) and,
    with more than one, their front, as subprocesses: what tests and benches run. `url` is where
    clients go (the front, or the one gateway)."""

    def __init__(
        self,
        model: str,
        engine_url: str,
        spool_dir: str,
        shards: int,
        *,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ):
        from palaestra.gateway.cli import gateway_process

        self.shards = [
            gateway_process(
                model, engine_url, shard_spool(spool_dir, i, shards), extra_args=list(extra_args), env=env
            )
            for i in range(shards)
        ]
        self.front = (
            front_process([p.url for p in self.shards], event_loop=_event_loop(extra_args))
            if shards > 1
            else None
        )

    @property
    def url(self) -> str:
        return (self.front or self.shards[0]).url

    def kill(self, shard: int) -> None:
        """SIGKILL shard `shard`'s process (nothing else: the front and the other shards go on)."""
        proc = self.shards[shard]
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def restart(self, shard: int) -> None:
        """Shard `shard` again on its port and spool directory (it replays its journal)."""
        self.shards[shard].restart()

    def __enter__(self) -> GatewayFleet:
        try:
            for proc in self.shards:
                proc.start()
            if self.front is not None:
                self.front.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in [*([self.front] if self.front else []), *self.shards]:
            proc.stop()

    def __exit__(self, *exc: object) -> None:
        self.stop()
