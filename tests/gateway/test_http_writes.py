"""The gateway's server protocol (gateway/http_writes.py): a whole answer's head and body go out in
one write, and every answer's bytes are those uvicorn's own protocol writes, in the same order."""

from __future__ import annotations

import asyncio
import os

import pytest
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from palaestra.gateway.http_writes import HeadJoiningProtocol, _HeadJoiner
from palaestra.testing.transport import StandInTransport


class _Recorder(StandInTransport):
    """A transport that records what is written to it (and what else is done to it)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def abort(self) -> None:
        self.closing = True
        self.events.append("abort")

    def is_closing(self) -> bool:
        return self.closing


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/json")
    async def json_answer() -> JSONResponse:
        return JSONResponse({"id": "chatcmpl-1", "choices": [{"text": "é"}]}, headers={"x-extra": "1"})

    @app.get("/empty")
    async def empty() -> Response:
        return Response(status_code=204)

    @app.api_route("/text", methods=["GET", "HEAD"])
    async def text() -> PlainTextResponse:
        return PlainTextResponse("hello")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> Response:
        raise RuntimeError("boom")

    return app


def _serve(protocol_class, requests: bytes) -> _Recorder:
    """What `protocol_class` writes for `requests` (raw HTTP/1.1 bytes, several may be pipelined)."""

    async def run() -> _Recorder:
        config = Config(_app(), log_level="critical", lifespan="off")
        state = ServerState()  # no default headers: no date to differ between runs
        proto = protocol_class(
            config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop()
        )
        transport = _Recorder()
        proto.connection_made(transport)
        proto.data_received(requests)
        for _ in range(200):  # the ASGI tasks run, pipelined ones after the answer before them
            await asyncio.sleep(0)
            if not state.tasks and not proto.pipeline:
                break
        await asyncio.sleep(0)
        if proto.timeout_keep_alive_task is not None:
            proto.timeout_keep_alive_task.cancel()
        return transport

    return asyncio.run(run())


POST_JSON = b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
CASES = {
    "json": POST_JSON,
    "no content": b"GET /empty HTTP/1.1\r\nhost: x\r\n\r\n",
    "head request": b"HEAD /text HTTP/1.1\r\nhost: x\r\n\r\n",
    "stream": b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n",
    "error": b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n",
    "not found": b"GET /nowhere HTTP/1.1\r\nhost: x\r\n\r\n",
    "connection close": b"GET /text HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    "pipelined": POST_JSON
    + b"GET /text HTTP/1.1\r\nhost: x\r\n\r\n"
    + b"HEAD /text HTTP/1.1\r\nhost: x\r\n\r\n",
    "http/1.0": b"GET /text HTTP/1.0\r\n\r\n",
}


@pytest.mark.parametrize("case", CASES)
def test_the_same_bytes_in_the_same_order_as_uvicorns_protocol(case):
    stock = _serve(HttpToolsProtocol, CASES[case])
    joined = _serve(HeadJoiningProtocol, CASES[case])
    assert stock.writes, "the stock protocol answered nothing: the case is wrong"
    assert b"".join(joined.writes) == b"".join(stock.writes)
    # a close comes after the same bytes as before
    assert joined.events.count("close") == stock.events.count("close")
    if "close" in stock.events:
        before = stock.events.index("close")
        assert b"".join(joined.writes[: joined.events.index("close")]) == b"".join(stock.writes[:before])


def test_a_whole_answer_is_one_write():
    """Fails on uvicorn's own protocol: head and body are two writes (two send syscalls) there."""
    stock = _serve(HttpToolsProtocol, POST_JSON)
    joined = _serve(HeadJoiningProtocol, POST_JSON)
    assert len(stock.writes) == 2
    assert len(joined.writes) == 1
    assert joined.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert joined.writes[0].endswith(b'{"id":"chatcmpl-1","choices":[{"text":"\xc3\xa9"}]}')


def test_a_streams_head_is_not_held():
    joined = _serve(HeadJoiningProtocol, CASES["stream"])
    assert b"transfer-encoding: chunked" in joined.writes[0]
    assert not joined.writes[0].endswith(b"data: 0\n\n\r\n")  # written before its first event
    assert len(joined.writes) == len(_serve(HttpToolsProtocol, CASES["stream"]).writes)


def test_the_joiner_ends_a_hold_on_close_abort_and_flush():
    real = _Recorder()
    joiner = _HeadJoiner(real)  # type: ignore[arg-type]
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    joiner.write(head)
    assert real.writes == []
    joiner.close()
    assert real.writes == [head] and real.events == ["write", "close"]
    real = _Recorder()
    joiner = _HeadJoiner(real)  # type: ignore[arg-type]
    joiner.write(head)
    joiner.abort()  # an abort drops what is buffered, as the transport's own does
    assert real.writes == [] and real.events == ["abort"]
    real = _Recorder()
    joiner = _HeadJoiner(real)  # type: ignore[arg-type]
    joiner.write(memoryview(head))
    joiner.writelines([b"o", b"k"])
    joiner.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # no length: written at once
    assert real.writes == [head, b"o", b"k", b"HTTP/1.1 100 Continue\r\n\r\n"]
    joiner.flush()
    assert len(real.writes) == 4
    assert joiner.get_extra_info("peername") == ("127.0.0.1", 1234)


def test_serve_runs_uvicorn_with_the_joining_protocol(monkeypatch, tmp_path):
    """...after freezing what start-up made (out of the collector's reach) and with the tokenizers'
    thread pool off unless set (the test process's own heap and environment are left as they were)."""
    import gc

    from palaestra.cli import build_parser
    from palaestra.gateway import app as gateway_app
    from palaestra.gateway import cli

    ran: dict = {}
    steps: list[str] = []
    monkeypatch.setattr(gateway_app, "create_app", lambda config: steps.append("app") or "app")
    monkeypatch.setattr(gc, "collect", lambda *a: steps.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: steps.append("freeze"))
    monkeypatch.setattr("palaestra.quiet_server.run", lambda app, **kw: steps.append("run") or ran.update(kw))
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    argv = [
        "gateway",
        "serve",
        "--model",
        "tiny",
        "--engine-url",
        "http://127.0.0.1:1",
        "--spool-dir",
        str(tmp_path),
    ]
    assert cli._serve(build_parser("gateway").parse_args(argv)) == 0
    assert ran["http"] is HeadJoiningProtocol
    assert steps == ["app", "collect", "freeze", "run"]
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_fastapis_own_telemetry_is_not_looked_up_per_request(monkeypatch, tok, tmp_path):
    """FastAPI (0.16x) asks OpenTelemetry for its three providers on every request unless told its
    instrumentation is off (gateway/app.py); nothing in the gateway configures one."""
    trace = pytest.importorskip(
        "opentelemetry.trace", reason="this FastAPI has no OpenTelemetry instrumentation"
    )
    import httpx

    from palaestra.gateway.app import create_app
    from tests.support.servers import gateway_config

    app = create_app(gateway_config("http://127.0.0.1:1", tmp_path / "spool", context_length=4096), tok)
    if not hasattr(app, "_native_telemetry"):
        pytest.skip("this FastAPI has no native telemetry to turn off")
    asked: list[int] = []
    real = trace.get_tracer_provider
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: asked.append(1) or real())

    async def call() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as http:
            return (await http.get("/health")).status_code

    assert asyncio.run(call()) == 200
    assert asked == []
    app.state.service.close()


def _body_app(received: list[list[bytes]]):
    """An ASGI app that reads its request's body message by message and answers its length."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        pieces: list[bytes] = []
        while True:
            message = await receive()
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        received.append(pieces)
        body = str(len(b"".join(pieces))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _feed(protocol_class, reads: list[bytes]) -> tuple[list[list[bytes]], _Recorder, list[str]]:
    """The body messages an app received from `protocol_class` fed `reads` one socket read at a
    time (the app's task runs between them), what the protocol wrote, and its reading pauses."""
    received: list[list[bytes]] = []
    flow_calls: list[str] = []

    async def run() -> _Recorder:
        config = Config(_body_app(received), log_level="critical", lifespan="off")
        state = ServerState()
        proto = protocol_class(
            config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop()
        )
        transport = _Recorder()
        transport.pause_reading = lambda: flow_calls.append("pause")  # type: ignore[method-assign]
        transport.resume_reading = lambda: flow_calls.append("resume")  # type: ignore[method-assign]
        proto.connection_made(transport)
        for read in reads:
            proto.data_received(read)
            for _ in range(5):
                await asyncio.sleep(0)
        for _ in range(200):
            await asyncio.sleep(0)
            if not state.tasks:
                break
        if proto.timeout_keep_alive_task is not None:
            proto.timeout_keep_alive_task.cancel()
        return transport

    transport = asyncio.run(run())
    return received, transport, flow_calls


def _reads(body: bytes, read: int, chunked: bool) -> list[bytes]:
    """A POST of `body` split into socket reads of `read` bytes (its head in the first)."""
    if chunked:  # chunks of 1000 bytes, whatever the reads
        framed = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]) for i in range(0, len(body), 1000)
        )
        wire = b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    else:
        wire = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    return [wire[i : i + read] for i in range(0, len(wire), read)]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_several_reads_reaches_the_app_in_one_piece(chunked):
    body = os.urandom(300_000)
    reads = _reads(body, 70_000, chunked)
    stock, stock_wrote, _ = _feed(HttpToolsProtocol, reads)
    gathered, wrote, pauses = _feed(HeadJoiningProtocol, reads)
    assert len(stock[0]) > 2, "uvicorn's protocol handed the body over whole: the case is wrong"
    assert b"".join(stock[0]) == b"".join(gathered[0]) == body
    assert gathered[0] == [body, b""] or gathered[0] == [body]
    assert b"".join(wrote.writes) == b"".join(stock_wrote.writes)  # the same answer
    assert "pause" not in pauses


def test_a_body_past_the_gather_limit_is_handed_over_in_pieces_and_reading_pauses(monkeypatch):
    monkeypatch.setattr("palaestra.gateway.http_writes.BODY_GATHER", 100_000)
    body = os.urandom(350_000)
    gathered, _, pauses = _feed(HeadJoiningProtocol, _reads(body, 30_000, False))
    pieces = [p for p in gathered[0] if p]
    assert b"".join(pieces) == body
    assert len(pieces) >= 3 and all(
        len(p) > 100_000 for p in pieces[:-1]
    )  # never more held than one read past it
    assert all(len(p) <= 100_000 + 30_000 for p in pieces)
    assert pauses.count("pause") >= 3


def test_pipelined_requests_keep_their_own_bodies():
    first, second = os.urandom(5000), os.urandom(7000)
    wire = b"".join(
        b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(b) + b for b in (first, second)
    )
    gathered, wrote, _ = _feed(HeadJoiningProtocol, [wire[i : i + 3000] for i in range(0, len(wire), 3000)])
    assert [b"".join(p) for p in gathered] == [first, second]
    assert wrote.writes[-1].endswith(b"7000")
