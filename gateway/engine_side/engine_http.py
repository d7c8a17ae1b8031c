"""The engine client's HTTP: a bare keep-alive HTTP/1.1 client (`bare`) or aiohttp's (`aiohttp`).

`gateway.engine_http` picks one (`auto` = bare where httptools imports and the engine URL is
http://, else aiohttp; a bare client opened by `auto` hands a call to an https:// URL, a worker's own
URL that routing replay posts to, to aiohttp's client, made for it on first use). Both do one thing,
what `EngineClient` asks: POST a body with a few headers, read the status and headers, then the body
whole or as it arrives. Both raise the same errors:
`ConnectionTimeoutError` (no connection within the connect timeout: nothing was sent),
`EngineConnectionError` (refused, reset, closed before the answer ended, not HTTP) and the builtin
`TimeoutError` (the call's total timeout passed).

The bare client is an `asyncio.Protocol` per connection on the running loop (uvloop's where the
gateway serves on it), httptools' response parser (llhttp, the parser uvicorn serves with), and a
pool of idle keep-alive connections per (host, port): at most `max_connections` open over all
hosts, callers beyond them queued until one is released (never failed for it). Content-Length,
chunked and close-delimited bodies; the request's head and body go out in one `transport.write`.
A connection the server closed while it was idle is dropped from the pool when the close arrives;
when the close crosses our write instead (the write or the first read on a reused connection fails
before any byte of the answer), the call goes again once on a fresh connection. An answer not read
to its end closes its connection (a client gone: the engine sees the close and aborts the request).
Its cost per call is what aiohttp's request and response objects, connector and stream reader add
up to without them: docs/gateway.md, "fifth part".
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

try:  # uvicorn's parser; the bare client needs it (auto falls back to aiohttp without it)
    import httptools
except ImportError:  # pragma: no cover - httptools is a pinned dependency
    httptools = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "ENGINE_HTTP",
    "Body",
    "AiohttpHttp",
    "BareHttp",
    "ConnectionTimeoutError",
    "EngineConnectionError",
    "open_http",
]

ENGINE_HTTP = ("auto", "bare", "aiohttp")

Body = bytes | Sequence[bytes | memoryview]
"""A request body: its bytes, or pieces whose join is them (the bare client writes them as they are)."""

# A streamed answer's bytes held unread above this stop the socket's reads until the reader catches up.
_HIGH_WATER = 1 << 20
# A stream whose reader saw its end marker ([DONE]) is left to end in the background and rejoins the
# pool when it does: given this long, and at most this many bytes more, else closed.
_DRAIN_S = 1.0
_DRAIN_BYTES = 1 << 16


class EngineConnectionError(Exception):
    """The connection failed: refused, reset, closed before the answer ended, or the answer not HTTP."""


class ConnectionTimeoutError(EngineConnectionError):
    """No connection within the connect timeout: nothing was sent."""


def open_http(
    choice: str, url: str, *, max_connections: int, connect_timeout_s: float, timeout_s: float
) -> BareHttp | AiohttpHttp:
    """The HTTP client `gateway.engine_http` names (`auto`: bare where it can serve `url`)."""
    if choice not in ENGINE_HTTP:
        raise ValueError(f"gateway.engine_http must be one of {', '.join(ENGINE_HTTP)} (got {choice!r})")
    bare_fits = httptools is not None and url.startswith("http://")
    if choice == "bare" and not bare_fits:
        raise ValueError(
            f"gateway.engine_http is bare but it speaks plain http:// with httptools installed ({url}): "
            "install httptools, or use auto or aiohttp"
        )
    limits = dict(max_connections=max_connections, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
    if choice == "bare":
        return BareHttp(**limits)
    if choice == "auto" and bare_fits:
        # the engine URL is http://, but routing replay posts to the workers' own URLs, which the
        # router lists and may be https://: those calls go through aiohttp's client
        return BareHttp(**limits, fallback=AiohttpHttp(**limits))
    return AiohttpHttp(**limits)


class _Connection(asyncio.Protocol):
    """One keep-alive connection, and the answer of the request it is carrying: its status, headers
    (names lower-cased) and body, read whole (`read`) or as it arrives (`read_some`)."""

    def __init__(self, pool: BareHttp, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle = False  # in the pool, between requests
        self.reused = False  # carried an answer before this request
        self.paused = False
        self.draining = False  # the reader is done; the rest of the body is awaited, then the pool
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False  # the answer allows another request on this connection
        self.delimited = True  # the body's end is known (a length, chunked, or no body): not EOF
        self.error: BaseException | None = None
        self.got_bytes = False
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.whole = False  # read whole (`read`), not as it comes (`read_some`)
        self.reader_done = False  # the reader saw the answer's end marker (`ended`)

    # -- one request --------------------------------------------------------------------------
    def send(self, data: tuple[bytes | memoryview, ...], deadline: float) -> None:
        """Writes the request's parts in one call (a `writev` under uvloop: a body in pieces is not
        joined into one copy first; at a 100k-token prompt the body is ~0.6 MB)."""
        self._begin()
        self._timer = self.loop.call_at(deadline, self._expire)
        assert self.transport is not None
        self.transport.writelines(data)

    async def head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        self.whole = True  # held whole whatever its size: the reads are never paused for it
        if self.paused:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read_some(self) -> bytes | None:
        """The body's bytes come since the last call (waiting for some), None once it ended."""
        while True:
            if self.pieces:
                pieces = self.pieces
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                self.pieces = []
                self.buffered = 0
                if self.paused and not self.closed:
                    self.paused = False
                    self.transport.resume_reading()  # type: ignore[union-attr]
                return data
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()

    def ended(self) -> None:
        """The reader saw the answer's own end (SGLang's `data: [DONE]`): what may still come is the
        body's framing, so leaving now keeps the connection (it rejoins the pool once the body ends)."""
        self.reader_done = True

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def close(self) -> None:
        self._disarm()
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
            self._wake()

    def _expire(self) -> None:
        self._timer = None
        self._fail(TimeoutError("the engine call's total timeout passed"))
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineConnectionError(f"the engine's answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self.head_done and not self.complete and not self.delimited:
            self.complete = True  # a body without a length ends where the connection does
            self._wake()
        else:
            self._fail(EngineConnectionError(f"the engine closed the connection: {exc or 'EOF'}"))
        if self.idle:
            self.pool._lost_idle(self)
        if self.draining:
            self.draining = False
            self.pool._drained(self)

    def pause_writing(self) -> None:  # the whole request is one write: the kernel takes it as it can
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools' callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        headers = self.headers
        self.delimited = (
            "content-length" in headers
            or "chunked" in headers.get("transfer-encoding", "")
            or self.status in (204, 304)
            or 100 <= self.status < 200
        )
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.draining:  # nobody reads it: dropped, and a body that goes on is not framing
            self.buffered += len(body)
            if self.buffered > _DRAIN_BYTES:
                self.close()
            return
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.whole and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser resets after
        self.complete = True
        self._disarm()
        self._wake()
        if self.draining:
            self.draining = False
            self.pool._drained(self)


class _BarePost:
    """`async with http.post(url, body, headers) as answer:` one request on a pooled connection; the
    connection goes back to the pool when the answer was read to its end, else it is closed."""

    __slots__ = ("http", "url", "body", "headers", "conn")

    def __init__(self, http: BareHttp, url: str, body: Body, headers: dict[str, str]) -> None:
        self.http = http
        self.url = url
        self.body = body
        self.headers = headers
        self.conn: _Connection | None = None

    async def __aenter__(self) -> _Connection:
        http = self.http
        key, data = http._request(self.url, self.body, self.headers)
        deadline = asyncio.get_running_loop().time() + http.timeout_s
        fresh = False
        while True:
            conn = await http._acquire(key, deadline, fresh)
            try:
                conn.send(data, deadline)
                await conn.head()
            except EngineConnectionError:
                http._release(conn)
                if conn.reused and not conn.got_bytes and not fresh:
                    fresh = True  # the server closed it while idle, as our request crossed the close
                    continue
                raise
            except BaseException:
                http._release(conn)
                raise
            self.conn = conn
            return conn

    async def __aexit__(self, kind: object, *exc: object) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if kind is None and conn.reader_done and not conn.complete and conn.error is None and not conn.closed:
            self.http._drain(conn)  # left at the stream's end marker: its last bytes are awaited
        else:
            self.http._release(conn)  # read to its end, or left midway: closed (the engine aborts)


class BareHttp:
    """The bare keep-alive HTTP/1.1 client (module doc). Made and used inside one event loop."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout_s: float,
        timeout_s: float,
        fallback: AiohttpHttp | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.fallback = fallback  # `auto`'s: posts to what is not http:// (https://) go through it
        self.opened = 0  # connections made, over the client's life (tests: keep-alive reuse)
        self._open = 0  # connections open now: idle and busy
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    def post(self, url: str, body: Body, headers: dict[str, str]) -> _BarePost | _AiohttpPost:
        if self.fallback is not None and not url.startswith("http://"):
            return self.fallback.post(url, body, headers)
        return _BarePost(self, url, body, headers)

    def serves(self, url: str) -> bool:
        """Whether a post to `url` can go out: http://, or anything with `auto`'s fallback."""
        return self.fallback is not None or url.startswith("http://")

    def _request(
        self, url: str, body: Body, headers: dict[str, str]
    ) -> tuple[tuple[str, int], tuple[bytes | memoryview, ...]]:
        """The connection key and the request's parts: its head, then the body's pieces."""
        target = self._targets.get(url)
        if target is None:
            split = urlsplit(url)
            if split.scheme != "http" or not split.hostname:
                raise ValueError(
                    f"gateway.engine_http is bare, which posts to http://host[:port]/path only (got {url!r}): "
                    "set gateway.engine_http to auto or aiohttp"
                )
            port = split.port or 80
            path = (split.path or "/") + (f"?{split.query}" if split.query else "")
            host = split.hostname if port == 80 else f"{split.hostname}:{port}"
            first = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
            target = self._targets[url] = ((split.hostname, port), first)
        key, first = target
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError(f"an engine call's header holds a line break: {headers!r}")
        parts = (body,) if isinstance(body, bytes) else tuple(body)
        size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        head = f"{lines}content-length: {size}\r\n\r\n".encode("latin-1")
        return key, (first + head, *parts)

    async def _acquire(self, key: tuple[str, int], deadline: float, fresh: bool) -> _Connection:
        """An idle connection to `key` (unless `fresh`), else a new one while fewer than
        `max_connections` are open (an idle one to another host closed to make room), else wait."""
        while True:
            idle = self._idle.get(key)
            if idle and not fresh:
                conn = idle.pop()
                conn.idle = False
                conn.reused = True
                return conn
            if self._open >= self.max_connections:
                self._close_an_idle()
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await self._connect(key)
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):  # the total timeout counts the wait, as aiohttp's
                    await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken but leaving: the next in line takes the free place
                else:
                    waiter.cancel()
                raise

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), *key)
        except TimeoutError:
            raise ConnectionTimeoutError(
                f"no connection to {key[0]}:{key[1]} within {self.connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise EngineConnectionError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None
        self.opened += 1
        return conn

    def _release(self, conn: _Connection) -> None:
        conn._disarm()
        self._drained(conn)

    def _drain(self, conn: _Connection) -> None:
        conn._disarm()
        conn.draining = True
        conn.pieces = []
        conn.buffered = 0
        if conn.paused:  # the reads a slow reader paused: the last chunk must come in
            conn.paused = False
            conn.transport.resume_reading()  # type: ignore[union-attr]
        conn._timer = conn.loop.call_later(_DRAIN_S, conn.close)  # on_message_complete cancels it

    def _drained(self, conn: _Connection) -> None:
        """An answer done with, or a drained one ended: its connection into the pool, else closed (its
        place free)."""
        if conn.reusable():
            conn.idle = True
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.close()
            self._open -= 1
        self._wake_one()

    def _lost_idle(self, conn: _Connection) -> None:
        """An idle connection the server closed: out of the pool, its place free."""
        conn.idle = False
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            self._open -= 1
            self._wake_one()

    def _close_an_idle(self) -> None:
        for idle in self._idle.values():
            if idle:
                conn = idle.pop(0)  # the longest idle
                conn.idle = False
                conn.close()
                self._open -= 1
                return

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.idle = False
                conn.close()
                self._open -= 1
            idle.clear()
        if self.fallback is not None:
            await self.fallback.close()


class _AiohttpAnswer:
    """aiohttp's response as `_Connection` answers: status, headers, read, read_some."""

    __slots__ = ("r", "status", "headers")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self.r = r
        self.status = r.status
        self.headers = r.headers

    async def read(self) -> bytes:
        with _aiohttp_errors():
            return await self.r.read()

    def ended(self) -> None:
        """aiohttp's connection is released, or closed when the body has not ended, as it decides."""

    async def read_some(self) -> bytes | None:
        with _aiohttp_errors():
            data = await self.r.content.readany()
        return data or None


class _aiohttp_errors:  # noqa: N801 - used as a context manager, read as one
    """aiohttp's exceptions as the bare client's: a connect timeout, a connection error, TimeoutError."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None:
            return
        import aiohttp

        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            raise ConnectionTimeoutError(repr(exc)) from exc
        if isinstance(exc, TimeoutError):  # aiohttp's other timeouts: the total one
            return
        if isinstance(exc, aiohttp.ClientError):
            raise EngineConnectionError(repr(exc)) from exc


class _AiohttpPost:
    __slots__ = ("http", "url", "body", "headers", "cm")

    def __init__(self, http: AiohttpHttp, url: str, body: Body, headers: dict[str, str]) -> None:
        self.http = http
        self.url = url
        self.body = body if isinstance(body, bytes) else b"".join(body)
        self.headers = headers
        self.cm: Any = None

    async def __aenter__(self) -> _AiohttpAnswer:
        self.cm = self.http._session().post(self.url, data=self.body, headers=self.headers)
        with _aiohttp_errors():
            return _AiohttpAnswer(await self.cm.__aenter__())

    async def __aexit__(self, *exc: Any) -> None:
        await self.cm.__aexit__(*exc)


class AiohttpHttp:
    """aiohttp's client (`gateway.engine_http: aiohttp`): its session made on first use, inside the
    serving event loop."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float, timeout_s: float) -> None:
        import aiohttp

        self.max_connections = max_connections
        # sock_connect, not connect: aiohttp's `connect` also counts the wait for a free pooled
        # connection, so with more calls in flight than `max_connections` queued calls failed as
        # engine_timeout (504) after 10 s although the engine was answering (tests/gateway/test_load.py).
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._client: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._client is None or self._client.closed:
            self._client = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                trust_env=False,
            )
        return self._client

    def post(self, url: str, body: Body, headers: dict[str, str]) -> _AiohttpPost:
        return _AiohttpPost(self, url, body, headers)

    def serves(self, url: str) -> bool:
        """aiohttp's client posts to http:// and https:// alike."""
        return True

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
