"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol with a whole answer's head
and body written to the socket together.

uvicorn writes a response's status line and headers (`http.response.start`) and then its body
(`http.response.body`) as two `transport.write` calls, and uvloop sends each at once: two send
syscalls, two TCP segments and two wake-ups of the client for an answer of a few hundred bytes,
on every unstreamed call (docs/gateway.md, issue 39's "per-call constant"). `HeadJoiningProtocol`
hands each connection's requests a transport (`_HeadJoiner`) that holds the head of an answer with
a length (uvicorn lower-cases the names it writes: ``content-length``) until the next write, which it
joins to; the end of the response (`on_response_complete`: a HEAD request, a 204), a close or an
abort ends the hold too. A stream's head (chunked, no length) and anything else are written at once.
The bytes on the wire and their order are the same; only their segmentation changes. Everything
but `write`, `writelines`, `close` and `abort` is the real transport's.

A request's body is gathered too. uvicorn appends each socket read of it to the request's buffer and
wakes the app's task for each; past 64 KiB it pauses reading until the app has taken what came.
The app (Starlette's `Request.body`) then joins the pieces, so a 500 KB body (a 100k-token history,
two reads under uvloop) was copied three times after the parser's own copy and woke the task twice.
`HeadJoiningProtocol` keeps a body's reads as they came until the body ends or `BODY_GATHER` bytes
are held, then hands them to the request as one piece (the read itself when there is one) and wakes
the task once: one copy for a body of several reads, none for one read. Past `BODY_GATHER` it hands
over what it holds and pauses reading as uvicorn does, so a body too large for the gateway (refused
by `guards.BodyLimit` as the app reads it, when no content-length announced it) holds at most
`BODY_GATHER` and one read before the app sees it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["BODY_GATHER", "HeadJoiningProtocol"]

BODY_GATHER = 4 << 20
"""Bytes of a request's body held before the app is handed them (module doc)."""

_HEAD = b"HTTP/1.1 "
_LENGTH = b"\r\ncontent-length: "


class _HeadJoiner:
    """A transport that holds a whole answer's head until the next write (module doc)."""

    __slots__ = ("_real", "_held")

    def __init__(self, real: asyncio.Transport) -> None:
        self._real = real
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._real.write(held + data)
        elif data[:9] == _HEAD and _LENGTH in data:
            self._held = bytes(data)
        else:
            self._real.write(data)

    def writelines(self, chunks: Any) -> None:
        self.flush()
        self._real.writelines(chunks)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._real.write(held)

    def close(self) -> None:
        self.flush()  # what was written goes out before the close, as it would have
        self._real.close()

    def abort(self) -> None:
        self._held = None  # an abort drops what is buffered
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class HeadJoiningProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a `_HeadJoiner` (module doc); pass it as uvicorn's `http`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _HeadJoiner(transport)  # type: ignore[assignment]
        self._held_body: list[bytes] = []  # the current request's body reads not handed over yet
        self._held_bytes = 0

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return  # where uvicorn drops a body too: answered already, or an upgrade's
        self._held_body.append(body)
        self._held_bytes += len(body)
        if self._held_bytes > BODY_GATHER:
            self._hand_over()
            self.flow.pause_reading()  # until the app has read it, as uvicorn pauses past 64 KiB

    def on_message_complete(self) -> None:
        self._hand_over()
        super().on_message_complete()

    def _hand_over(self) -> None:
        """The held reads into the request's buffer as one piece, its task woken."""
        held = self._held_body
        if not held:
            return
        piece = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self._held_bytes = 0
        cycle = self.cycle
        # uvicorn's `receive` hands the app `bytes(cycle.body)`: the very piece when it is bytes
        cycle.body = cycle.body + piece if cycle.body else piece  # type: ignore[assignment]
        cycle.message_event.set()

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]  # a head whose body was empty or not sent
        super().on_response_complete()
