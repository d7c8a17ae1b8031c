"""A large request body's way from the socket's reads to the app: the gateway's HTTP protocol
(`gateway/http_writes.py`), which gathers a body's reads and hands them over as one piece, against
the same protocol handing each read over as uvicorn's does. One run, interleaved, ratios.

    .venv/bin/python -m bench.body_receive [--kb 500,64,8] [--read-kb 256] [--rounds 40]

Each request is a POST of `--kb` kilobytes (a 100k-token chat history is ~500 KB of JSON) fed to the
protocol in socket reads of `--read-kb` (uvloop reads up to 256 KB at a time), one event-loop pass
between reads as a socket would give, then read by a Starlette `Request.body()` as the gateway's
routes read it; the answer is a few bytes. The transport is a stand-in that keeps nothing, so the
figures are the Python and copying of the way, without the syscalls (the same on both ways). Printed
per size: microseconds per request on each way (median of `--rounds` rounds of 20 requests each, the
two ways alternating), the ratio, and how many times the app called `receive` for the body.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from starlette.requests import Request
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from bench import common
from palaestra.gateway.http_writes import HeadJoiningProtocol
from palaestra.testing.transport import StandInTransport


class _ReadByRead(HeadJoiningProtocol):
    """The gateway's protocol with uvicorn's own body handling: each read handed over as it comes."""

    on_body = HttpToolsProtocol.on_body
    on_message_complete = HttpToolsProtocol.on_message_complete


async def _app(scope, receive, send) -> None:
    body = await Request(scope, receive).body()
    answer = b"%d" % len(body)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
    )
    await send({"type": "http.response.body", "body": answer})


def _counting(app):
    """`app` with its receive calls counted (the pieces the body came in)."""

    async def counted(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        calls = 0

        async def counting_receive():
            nonlocal calls
            calls += 1
            return await receive()

        await app(scope, counting_receive, send)
        counted.pieces = calls  # type: ignore[attr-defined]

    counted.pieces = 0  # type: ignore[attr-defined]
    return counted


async def _requests(protocol_class, reads: list[bytes], n: int, app) -> float:
    """Seconds for `n` requests of `reads` on one kept-alive connection."""
    config = Config(app, log_level="critical", lifespan="off")
    state = ServerState()
    proto = protocol_class(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    proto.connection_made(StandInTransport())
    started = time.perf_counter()
    for _ in range(n):
        for read in reads:
            proto.data_received(read)
            await asyncio.sleep(0)  # a socket gives the loop a pass between reads
        while state.tasks:
            await asyncio.sleep(0)
    took = time.perf_counter() - started
    if proto.timeout_keep_alive_task is not None:
        proto.timeout_keep_alive_task.cancel()
    return took


async def _compare(
    ways: dict, reads: list[bytes], rounds: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per request on each way (a round each, alternating), and the receive calls of each."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    pieces: dict[str, int] = {}
    for cls in ways.values():  # warm-up
        await _requests(cls, reads, 5, _counting(_app))
    for _ in range(rounds):
        for name, cls in ways.items():
            app = _counting(_app)
            times[name].append(await _requests(cls, reads, 20, app) / 20)
            pieces[name] = app.pieces  # type: ignore[attr-defined]
    return times, pieces


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--kb", default="500,64,8", help="body sizes, kilobytes (comma-separated)")
    ap.add_argument("--read-kb", type=int, default=256, help="bytes per socket read, kilobytes")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of 20 requests per way")
    args = ap.parse_args()
    try:
        sizes = [int(k) for k in args.kb.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--kb takes sizes of 1 or more, comma-separated; got {args.kb!r}")
    if args.read_kb < 1:
        ap.error(f"--read-kb must be 1 or more; got {args.read_kb}")
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more; got {args.rounds}")
    stock, ours = "read by read", "gathered"
    ways = {stock: _ReadByRead, ours: HeadJoiningProtocol}
    print(f"a POST body read in reads of {args.read_kb} KB, then Request.body(); us per request:")
    for kb in sizes:
        body = b"x" * (kb * 1000)
        wire = (
            b"POST /s/x/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
            + body
        )
        step = args.read_kb * 1000
        reads = [wire[i : i + step] for i in range(0, len(wire), step)]
        times, pieces = asyncio.run(_compare(ways, reads, args.rounds))
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        print(
            f"  {kb} KB in {len(reads)} reads: {stock} {med[stock]:.1f} us ({pieces[stock]} receive calls), "
            f"{ours} {med[ours]:.1f} us ({pieces[ours]}) -> {med[ours] / med[stock]:.2f}x"
        )


if __name__ == "__main__":
    main()
