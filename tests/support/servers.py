"""Servers for the tests: the gateway under test, servers in threads, a recording proxy, and a
scripted engine.

`gateway_server` is the one way a test builds the gateway it talks to: the `tiny` preset, the test
keys (`ENV_KEY`, `ADMIN_KEY`), the test's spool directory and whatever options the test sets.

`ScriptedEngine` is a TEST DOUBLE: it speaks SGLang's /generate but answers with token ids the test
chose (so a random-weight model can "call tools" on cue). It never stands in for the engine in a
feature test about generation itself; those use the real embedded engine, through
`RecordingProxy`, which forwards to it and records every request, header and answer.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from palaestra.quiet_server import QuietServer

ENV_KEY = "k-test"
ADMIN_KEY = "k-admin"
INSECURE = {"api_key": None, "admin_key": None, "insecure_local": True}  # no keys: --insecure-local


def gateway_config(engine_url: str, spool_dir: Any, **options: Any) -> Any:
    """The gateway's config under test: the `tiny` preset and the test keys, `options` on top."""
    from palaestra.gateway.config import GatewayConfig

    defaults = {"model": "tiny", "api_key": ENV_KEY, "admin_key": ADMIN_KEY}
    return GatewayConfig(**{**defaults, **options, "engine_url": engine_url, "spool_dir": str(spool_dir)})


def gateway_server(
    engine_url: str, spool_dir: Any, tokenizer: Any = None, *, server: type | None = None, **options: Any
) -> ThreadServer:
    """The gateway app (`gateway_config`) served in a thread; use as a context manager. `.app` is the
    app (its `app.state.service` is the turn core). `tokenizer` saves loading the preset's again."""
    from palaestra.gateway.app import create_app
    from palaestra.gateway.http_writes import HeadJoiningProtocol

    app = create_app(gateway_config(engine_url, spool_dir, **options), tokenizer=tokenizer)
    # the server protocol `palaestra gateway serve` runs (gateway/http_writes.py)
    return (server or ThreadServer)(app, http=HeadJoiningProtocol)


class ThreadServer:
    """Runs an ASGI app with uvicorn on a free 127.0.0.1 port in a daemon thread (`http`: uvicorn's
    protocol option)."""

    def __init__(self, app: Any, http: Any = "auto"):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = QuietServer(  # stops as soon as should_exit is set
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=1,
                http=http,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class Exchange:
    headers: dict[str, str]
    body: dict[str, Any]
    answer: Any = None


@dataclass
class RecordingProxy:
    """Forwards /generate to a real engine and records what went in and out (stream or not)."""

    engine_url: str
    exchanges: list[Exchange] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()
        # Pooled connections are dropped after 2 s idle, before the engine's uvicorn closes them at
        # 5 s: a request sent on a connection the engine is closing fails with ReadError, and the
        # proxy would hand the gateway a 500 the engine never gave (seen in CI on a loaded machine).
        client = httpx.AsyncClient(timeout=300, trust_env=False, limits=httpx.Limits(keepalive_expiry=2.0))

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.json()
            ex = Exchange({k.lower(): v for k, v in request.headers.items()}, body)
            self.exchanges.append(ex)
            if body.get("stream"):

                async def relay():
                    # Each chunk is recorded before it is passed on: the gateway may answer its
                    # client on the last one before this generator runs to its end, and a test
                    # that reads `exchanges` then must find the answer.
                    for attempt in (1, 2):
                        sent = False
                        try:
                            async with client.stream("POST", f"{self.engine_url}/generate", json=body) as r:
                                async for line in r.aiter_lines():
                                    if line.startswith("data: ") and line != "data: [DONE]":
                                        ex.answer = json.loads(line[6:])
                                    sent = True
                                    yield line + "\n"
                            return
                        except (httpx.ReadError, httpx.RemoteProtocolError):
                            if sent or attempt == 2:  # the pooled-connection race: once more, if nothing went
                                raise

                return StreamingResponse(relay(), media_type="text/event-stream")
            try:
                r = await client.post(f"{self.engine_url}/generate", json=body)
            except (httpx.ReadError, httpx.RemoteProtocolError):  # that race at the margin: once more
                r = await client.post(f"{self.engine_url}/generate", json=body)
            ex.answer = r.json()
            return JSONResponse(ex.answer, status_code=r.status_code)

        @app.get("/server_info")
        async def server_info() -> Any:
            return (await client.get(f"{self.engine_url}/server_info")).json()

        return app


class TextScript:
    """What a `ScriptedEngine` says next: a queue of texts, each tokenized and ended by the `stop`
    token (unless its call index is in `no_end`); `default` when the queue is empty (None: the test
    must have queued every answer)."""

    def __init__(self, tok: Any, stop: str = "<|im_end|>", default: str | None = "ok"):
        self.tok = tok
        self.queue: list[str] = []
        self.end = tok.convert_tokens_to_ids(stop)
        self.default = default
        self.no_end: set[int] = set()

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        if not self.queue and self.default is None:
            raise AssertionError(f"the engine was called (call {index}) with no answer queued")
        text = self.queue.pop(0) if self.queue else self.default
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids if index in self.no_end else ids + [self.end]


@dataclass
class ScriptedEngine:
    """TEST DOUBLE of an SGLang engine: `script(input_ids, call_index)` returns the output ids to send.

    Answers the /generate shape exactly (output_ids incl. the stop token, [logprob, id, None] triples,
    finish_reason stop/length), records every request with its headers, and can fail on demand.
    Streams as SGLang does (a chunk per token, the last with the finish reason): each chunk the whole
    output so far, its default, or with `incremental` (its --incremental-streaming-output; the
    gateway's `engine_incremental_stream`) only the new token — linear in the answer's length
    where the default's bytes grow with its square (a 4000-token answer: 235 MB, 5 s here).
    """

    script: Callable[[list[int], int], list[int]]
    stop_ids: set[int]
    context_length: int = 32768
    weight_version: str = "scripted"
    exchanges: list[Exchange] = field(default_factory=list)
    fail_next: int = 0  # answer this many calls with 503 (nothing generated)
    delay_s: float = 0.0
    incremental: bool = False  # stream deltas (SGLang's --incremental-streaming-output)
    # streams the first chunk, then waits until this is set (60 s at most) before the rest: the
    # first chunk is then read on its own, whatever the machine's timing
    hold_stream: threading.Event | None = None

    def _answer(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        ids = self.script(list(body["input_ids"]), index)
        max_new = body.get("sampling_params", {}).get("max_new_tokens", 128)
        out = ids[:max_new]
        finish = (
            {"type": "stop", "matched": out[-1]}
            if out and out[-1] in self.stop_ids
            else {"type": "length", "length": max_new}
        )
        lps = [[-0.5 - 0.001 * i, t, None] for i, t in enumerate(out)]
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "id": f"r{index}",
                "finish_reason": finish,
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                "output_token_logprobs": lps,
            },
        }

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            import asyncio

            body = await request.json()
            self.exchanges.append(Exchange({k.lower(): v for k, v in request.headers.items()}, body))
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=503)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            answer = self._answer(body, len(self.exchanges) - 1)
            self.exchanges[-1].answer = answer
            if not body.get("stream"):
                return JSONResponse(answer)

            def events():
                ids, lps = answer["output_ids"], answer["meta_info"]["output_token_logprobs"]
                for k in range(1, len(ids) + 1):
                    start = k - 1 if self.incremental else 0
                    meta = {
                        **answer["meta_info"],
                        "output_token_logprobs": lps[start:k],
                        "finish_reason": answer["meta_info"]["finish_reason"] if k == len(ids) else None,
                    }
                    yield f"data: {json.dumps({'text': '', 'output_ids': ids[start:k], 'meta_info': meta})}\n\n"
                    if k == 1 and self.hold_stream is not None:
                        self.hold_stream.wait(60)  # (a sync iterator: Starlette runs it in a thread)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"context_length": self.context_length}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        return app
