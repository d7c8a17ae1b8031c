"""The engine client's bare HTTP/1.1 client (gateway/engine_side/engine_http.py) against real servers:
uvicorn, aiohttp's, a raw asyncio server that answers exactly the bytes a case needs, and the embedded
engine; and `EngineClient` over it and over aiohttp's (`gateway.engine_http`)."""

from __future__ import annotations

import asyncio
import threading
import time

import orjson
import pytest
import uvicorn
from aiohttp import web
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.engine_side.engine_http import (
    BareHttp,
    EngineConnectionError,
    open_http,
)
from palaestra.gateway.engine_side.generation import SamplingParams
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.options import GatewayOptions


def _http(**kw) -> BareHttp:
    return BareHttp(**{"max_connections": 8, "connect_timeout_s": 2.0, "timeout_s": 10.0, **kw})


class RawServer:
    """An asyncio server on the test's loop whose `answer(reader, writer, index)` writes each
    request's answer byte for byte; it records every request's head and counts connections."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if await self.answer(reader, writer, len(self.requests) - 1) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            self.open -= 1
            writer.close()


def _ok(body: bytes = b'{"ok":1}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def test_content_length_chunked_and_close_delimited_bodies_are_read_whole_and_as_they_come():
    async def answer(reader, writer, i):
        if i == 0:  # larger than the unread bytes a stream holds before its reads pause
            writer.write(_ok(b"x" * 3_000_000))
        elif i == 1:  # chunked, in three writes
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b"6\r\n world\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
        else:  # no length: the body ends where the connection does
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
            await writer.drain()
            return False
        await writer.drain()

    async def main():
        http = _http()
        async with RawServer(answer) as srv:
            async with http.post(srv.url, b"{}", {"a": "1"}) as r:
                assert r.status == 200 and r.headers["content-type"] == "application/json"
                assert await r.read() == b"x" * 3_000_000
            async with http.post(srv.url, b"{}", {}) as r:
                pieces = []
                while (data := await r.read_some()) is not None:
                    pieces.append(data)
            assert b"".join(pieces) == b"hello world" and len(pieces) >= 2  # handed on as they came
            async with http.post(srv.url, b"[1]", {}) as r:
                assert await r.read() == b"until the end"
            assert srv.connections == 1 and http.opened == 1  # one keep-alive connection for all three
            assert srv.requests[2].startswith(b"POST /generate HTTP/1.1\r\n")
            assert (
                srv.requests[2].endswith(b"content-length: 3\r\n\r\n[1]") and b"a: 1\r\n" in srv.requests[0]
            )
        await http.close()

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_in_pieces_goes_out_as_their_join_from_either_client(loop):
    """`EngineClient` hands the /generate body over in pieces (bytes and a memoryview, as
    `EncodedIds` makes them); the bare client writes them as they are (`writelines`: one writev under
    uvloop, the gateway's loop), aiohttp's joins them: the server reads their join, with its length."""
    pieces = [b'{"input_ids":', b"[" + b"1," * 300_000, b"2]", b",", memoryview(b'{"k":1}')[1:]]
    joined = b"".join(pieces)

    async def answer(reader, writer, i):
        writer.write(_ok())
        await writer.drain()

    async def main():
        async with RawServer(answer) as srv:
            aio = open_http("aiohttp", srv.url, max_connections=8, connect_timeout_s=2.0, timeout_s=10.0)
            for http in (_http(), aio):
                async with http.post(srv.url, pieces, {"a": "1"}) as r:
                    assert await r.read() == b'{"ok":1}'
                await http.close()
            for request in srv.requests:
                head, body = request.split(b"\r\n\r\n", 1)
                assert body == joined and f"content-length: {len(joined)}".encode() in head.lower()
            assert len(srv.requests) == 2

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def test_a_reused_connection_the_server_closed_is_retried_once_on_a_fresh_one():
    """The server takes the second request on the first connection and closes it unanswered (as a
    keep-alive close crossing our write does): the call goes again on a new connection and is
    answered; on a fresh connection the same failure is the caller's error, not retried."""

    async def answer(reader, writer, i):
        if i == 1:
            return False  # closed, nothing answered
        writer.write(_ok())
        await writer.drain()

    async def main():
        http = _http()
        async with RawServer(answer) as srv:
            for _ in range(2):
                async with http.post(srv.url, b"{}", {}) as r:
                    assert await r.read() == b'{"ok":1}'
            assert srv.connections == 2 and len(srv.requests) == 3

        async def never(reader, writer, i):
            return False

        http2 = _http()
        async with RawServer(never) as srv:
            with pytest.raises(EngineConnectionError, match="closed the connection"):
                async with http2.post(srv.url, b"{}", {}):
                    pass
            assert srv.connections == 1
        await http.close()

    asyncio.run(main())


def test_a_server_dying_mid_answer_is_an_error_and_a_client_gone_closes_the_connection():
    async def answer(reader, writer, i):
        if i == 0:  # half the promised body, then the process is gone
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 50)
            await writer.drain()
            return False
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await reader.read(1)  # the stream goes on until the client goes: then EOF
        srv.closed_by_client.set()
        return False

    async def main():
        nonlocal srv
        http = _http()
        async with RawServer(answer) as srv:
            with pytest.raises(EngineConnectionError, match="closed the connection"):
                async with http.post(srv.url, b"{}", {}) as r:
                    await r.read()
            async with http.post(srv.url, b"{}", {}) as r:
                assert await r.read_some() == b"hi"
            # left unread: the connection is closed, the server sees its client go
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)
            assert http._open == 0 and not any(http._idle.values())
        await http.close()

    srv: RawServer
    asyncio.run(main())


def test_callers_beyond_max_connections_wait_for_a_free_one_and_none_fails():
    async def answer(reader, writer, i):
        await asyncio.sleep(0.03)
        writer.write(_ok(b"%d" % i))
        await writer.drain()

    async def main():
        http = _http(max_connections=2)

        async def one(i: int) -> bytes:
            async with http.post(srv.url, b"%d" % i, {}) as r:
                return await r.read()

        async with RawServer(answer) as srv:
            answers = await asyncio.gather(*(one(i) for i in range(9)))
            assert sorted(int(a) for a in answers) == list(range(9))
            assert srv.most_open == 2 and srv.connections == 2 and http._open == 2
        await http.close()

    asyncio.run(main())


def test_the_total_timeout_is_a_timeout_and_the_connect_timeout_counts_from_the_connect():
    async def slow(reader, writer, i):
        await asyncio.sleep(5)

    async def main():
        async with RawServer(slow) as srv:
            http = _http(timeout_s=0.2)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with http.post(srv.url, b"{}", {}) as r:
                    await r.read()
            assert time.monotonic() - t0 < 2
            # a caller queued behind a busy connection longer than the connect timeout is not
            # refused for it (the pool wait is not the connect)
            http = _http(max_connections=1, connect_timeout_s=0.05, timeout_s=10.0)
            quick = RawServer(lambda r, w, i: _answer_after(w, 0.2))
            async with quick:
                results = await asyncio.gather(
                    *(_read(http, quick.url) for _ in range(3)), return_exceptions=True
                )
            assert results == [b'{"ok":1}'] * 3, results
            await http.close()

    asyncio.run(main())


async def _answer_after(writer, delay: float) -> None:
    await asyncio.sleep(delay)
    writer.write(_ok())
    await writer.drain()


async def _read(http: BareHttp, url: str) -> bytes:
    async with http.post(url, b"{}", {}) as r:
        return await r.read()


def test_against_uvicorn_and_aiohttp_servers_keep_alive_reuse_and_idle_closes():
    """uvicorn closes a keep-alive connection after `timeout_keep_alive` idle: the next call opens a
    new one and does not fail; aiohttp's server streams chunked."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        return JSONResponse({"got": orjson.loads(await request.body()), "key": request.headers["x-k"]})

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_keep_alive=0.2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/generate"

    async def chunks(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        out.enable_chunked_encoding()
        await out.prepare(request)
        for i in range(3):
            await out.write(b"data: %d\n" % i)
            await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    async def main():
        http = _http()
        for i in range(3):
            async with http.post(url, b'{"i":%d}' % i, {"x-k": "s1"}) as r:
                assert orjson.loads(await r.read()) == {"got": {"i": i}, "key": "s1"}
        assert http.opened == 1
        await asyncio.sleep(0.6)  # uvicorn closed it meanwhile
        async with http.post(url, b'{"i":9}', {"x-k": "s1"}) as r:
            assert r.status == 200 and orjson.loads(await r.read())["got"] == {"i": 9}
        assert http.opened == 2

        aio = web.Application()
        aio.router.add_post("/generate", chunks)
        runner = web.AppRunner(aio)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        aio_url = f"http://127.0.0.1:{runner.addresses[0][1]}/generate"
        for _ in range(2):
            async with http.post(aio_url, b"{}", {}) as r:
                got = b""
                while (data := await r.read_some()) is not None:
                    got += data
            assert got == b"data: 0\ndata: 1\ndata: 2\n"
        await http.close()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("value", ["httpx", "", None, 1, "BARE"])
def test_engine_http_outside_its_choices_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"gateway.engine_http must be one of auto, bare, aiohttp"):
        GatewayOptions(engine_http=value)


def test_the_bare_client_refuses_https_and_auto_falls_back_to_aiohttp():
    with pytest.raises(ValueError, match="gateway.engine_http is bare but it speaks plain http://"):
        open_http("bare", "https://e", max_connections=1, connect_timeout_s=1, timeout_s=1)
    assert type(
        open_http("auto", "https://e", max_connections=1, connect_timeout_s=1, timeout_s=1)
    ).__name__ == ("AiohttpHttp")
    assert isinstance(
        open_http("auto", "http://e", max_connections=1, connect_timeout_s=1, timeout_s=1), BareHttp
    )


def test_auto_posts_to_an_https_worker_through_aiohttp_and_bare_names_the_option():
    """A router on http:// whose workers are https:// (routing replay posts to them): `auto`'s bare
    client hands those calls to aiohttp's, whose first bytes on the socket are a TLS handshake (the
    127.0.0.1 server here records them and hangs up, so the call fails as a broken connection); the
    bare client alone refuses the URL in one line naming gateway.engine_http, sending nothing."""
    first: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first.append(await reader.read(3))
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/generate"
        auto = open_http("auto", "http://router", max_connections=2, connect_timeout_s=2, timeout_s=5)
        bare = open_http("bare", "http://router", max_connections=2, connect_timeout_s=2, timeout_s=5)
        assert auto.serves(url) and not bare.serves(url) and bare.serves("http://w/generate")
        try:
            with pytest.raises(EngineConnectionError):
                async with auto.post(url, b"{}", {"content-type": "application/json"}) as r:
                    await r.read()
            assert first and first[0][:1] == b"\x16"  # a TLS record: the handshake
            with pytest.raises(ValueError) as caught:
                async with bare.post(url, b"{}", {}) as r:
                    await r.read()
            message = str(caught.value)
            assert "gateway.engine_http is bare" in message and "auto or aiohttp" in message
            assert len(first) == 1 and bare.opened == 0 and auto.opened == 0
        finally:
            await auto.close()
            await bare.close()
            server.close()

    asyncio.run(main())


@pytest.mark.parametrize("engine_http", ["bare", "aiohttp"])
def test_engine_client_over_either_http_answers_errors_and_breaks_alike(engine_http):
    """200, a 4xx (400 engine_rejected, not retried), a 5xx (retried, then 503), a stream broken
    after its first chunk (502, not retried) and a refused connection (503 unreachable)."""

    def chunk(ids: list[int], finish: object) -> bytes:
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": finish}
        return b"data: " + orjson.dumps({"output_ids": ids, "meta_info": meta}) + b"\n\n"

    async def answer(reader, writer, i):
        body = srv.requests[-1].split(b"\r\n\r\n", 1)[1]
        ids = orjson.loads(body)["input_ids"]
        if ids == [1]:
            writer.write(_ok(chunk([5, 6], {"type": "stop"})[6:-2]))
        elif ids == [2]:
            writer.write(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 16\r\n\r\n{"message":"no"}')
        elif ids == [3]:
            writer.write(b"HTTP/1.1 500 Oops\r\ncontent-length: 4\r\n\r\nboom")
        else:  # a stream that breaks after its first chunk
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            first = chunk([7], None)
            writer.write(b"%x\r\n%s\r\n" % (len(first), first))
            await writer.drain()
            return False
        await writer.drain()

    def engine_client(url: str) -> EngineClient:
        return EngineClient(
            url.removesuffix("/generate"),
            retries=1,
            retry_backoff_s=0.0,
            timeout_s=10.0,
            engine_http=engine_http,
        )

    async def main():
        nonlocal srv
        async with RawServer(answer) as srv:
            client = engine_client(srv.url)
            sampling = SamplingParams({}, 4)
            (gen,) = await client.generate("s1", [1], sampling)
            assert gen.output_ids == [5, 6] and gen.finish_reason.kind == "stop"
            assert b"x-smg-routing-key: s1\r\n" in srv.requests[0].lower()
            with pytest.raises(GatewayError) as caught:
                await client.generate("s1", [2], sampling)
            assert (caught.value.status, caught.value.code) == (400, "engine_rejected")
            before = len(srv.requests)
            with pytest.raises(GatewayError) as caught:
                await client.generate("s1", [3], sampling)
            assert caught.value.status == 503 and len(srv.requests) - before == 2  # retried once
            before = len(srv.requests)
            got = []
            with pytest.raises(GatewayError) as caught:
                async for ids, _, _ in client.stream("s1", [4], sampling):
                    got += ids
            assert got == [7] and caught.value.status == 502 and "mid-stream" in str(caught.value)
            assert len(srv.requests) - before == 1  # a token went out: never retried
            await client.close()
        gone = engine_client(srv.url)
        with pytest.raises(GatewayError) as caught:
            await gone.generate("s1", [1], SamplingParams({}, 4))
        assert caught.value.code == "engine_unavailable" and "unreachable" in str(caught.value)
        await gone.close()

    srv: RawServer
    asyncio.run(main())


@pytest.mark.engine
@pytest.mark.parametrize("engine_http", ["bare", "aiohttp"])
def test_engine_client_against_the_embedded_engine(engine, engine_http):
    """The real engine (`palaestra engine serve --model tiny`): a whole answer and a streamed one give
    the same ids, over one keep-alive connection with the bare client."""

    async def main():
        client = EngineClient(engine.url, engine_http=engine_http)
        sampling = SamplingParams({"temperature": 0.0}, 6)
        (whole,) = await client.generate("s1", [1, 2, 3, 4], sampling)
        streamed = [i async for ids, _, _ in client.stream("s1", [1, 2, 3, 4], sampling) for i in ids]
        (again,) = await client.generate("s1", [1, 2, 3, 4], sampling)
        assert whole.output_ids == streamed == again.output_ids and len(whole.output_ids) == 6
        if engine_http == "bare":  # the whole answers on one connection (a stream's may close on [DONE])
            assert client.http.opened <= 2
        await client.close()

    asyncio.run(main())


def test_a_stream_left_at_its_done_marker_rejoins_the_pool_and_one_that_never_ends_is_closed(monkeypatch):
    """SGLang ends a stream with `data: [DONE]`, the chunked body's last chunk after it: the client
    leaves at the marker, the connection rejoins the pool when that chunk comes (the next calls reuse
    it), and is closed when it does not come within the drain time."""
    from palaestra.gateway.engine_side import engine_http

    monkeypatch.setattr(engine_http, "_DRAIN_S", 0.2)
    meta = {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "stop"}}
    event = b"data: " + orjson.dumps({"output_ids": [7], "meta_info": meta}) + b"\n\ndata: [DONE]\n\n"

    async def answer(reader, writer, i):
        writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
        )
        await writer.drain()
        if i == 3:  # the last chunk never comes
            await reader.read(1)
            srv.closed_by_client.set()
            return False
        await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main():
        nonlocal srv
        async with RawServer(answer) as srv:
            client = EngineClient(srv.url.removesuffix("/generate"), timeout_s=10.0)
            for call in range(4):
                got = [i async for ids, _, _ in client.stream("s", [1], SamplingParams({}, 4)) for i in ids]
                assert got == [7]
                if call < 3:
                    await asyncio.sleep(0.1)  # the last chunk came meanwhile: back in the pool
                    assert client.http._open == 1 and len(client.http._idle[srv_key(srv)]) == 1
            assert srv.connections == 1 and len(srv.requests) == 4
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)  # closed after the drain time
            await asyncio.sleep(0.05)
            assert client.http._open == 0
            await client.close()

    srv: RawServer
    asyncio.run(main())


def srv_key(srv: RawServer) -> tuple[str, int]:
    return ("127.0.0.1", srv.server.sockets[0].getsockname()[1])
