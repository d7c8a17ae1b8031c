"""A TEST DOUBLE for the gateway bench: the least a Python hop in front of the engine can cost.

    .venv/bin/python -m bench._passthrough --engine-url http://127.0.0.1:30000 --port 8001

A raw ASGI app served as the gateway is (uvicorn, httptools, the same event loop choice) that reads
each POST's body and posts the same bytes to the engine's /generate with the gateway's own engine
HTTP client (`gateway.engine_http`'s `bare` unless --engine-http says otherwise), then answers the
engine's status and body. No parsing, rendering, sessions or records: `bench.gateway --parts
overhead` prints its overhead as the floor under the gateway's rows. Not a product: nothing but the
bench starts it.
"""

from __future__ import annotations

import sys

import uvicorn

from bench import common
from palaestra.gateway.engine_side.engine_http import ENGINE_HTTP, open_http
from palaestra.gateway.event_loop import EVENT_LOOPS, loop_name
from palaestra.net import ServerProcess, free_port

_JSON = [(b"content-type", b"application/json")]


def app(engine_url: str, engine_http: str):
    target = f"{engine_url.rstrip('/')}/generate"
    http = open_http(engine_http, target, max_connections=64, connect_timeout_s=10.0, timeout_s=60.0)

    async def asgi(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await http.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":  # /health: the readiness poll
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        pieces = []
        while True:
            message = await receive()
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        key = dict(scope["headers"]).get(b"x-smg-routing-key", b"k").decode()
        headers = {"x-smg-routing-key": key, "content-type": "application/json"}
        async with http.post(target, b"".join(pieces), headers) as r:
            body = await r.read()
            status = r.status
        await send({"type": "http.response.start", "status": status, "headers": _JSON})
        await send({"type": "http.response.body", "body": body})

    return asgi


def process(engine_url: str, *, engine_http: str = "bare", event_loop: str = "auto") -> ServerProcess:
    """This double as a subprocess on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "bench._passthrough", "--engine-url", engine_url, "--port", str(port)]
    argv += ["--engine-http", engine_http, "--event-loop", event_loop]
    return ServerProcess(argv, f"http://127.0.0.1:{port}", name=f"passthrough-{port}", free_ports=["--port"])


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--engine-url", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-http", default="bare", choices=ENGINE_HTTP)
    ap.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS)
    args = ap.parse_args()
    loop = loop_name(args.event_loop, "bench._passthrough")
    uvicorn.run(
        app(args.engine_url, args.engine_http),
        host="127.0.0.1",
        port=args.port,
        loop=loop,
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
