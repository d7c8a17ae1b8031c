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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HeadJoiningProtocol"]

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

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]  # a head whose body was empty or not sent
        super().on_response_complete()
