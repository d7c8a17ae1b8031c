"""Which asyncio event loop the gateway's servers run on: `gateway.event_loop` (auto, asyncio, uvloop).

uvloop (libuv under asyncio's interface) makes each socket read, write and loop pass cheaper, which
is most of what a streamed token and an unstreamed call's HTTP exchange cost the gateway
(docs/gateway.md, "Performance"). ``auto`` takes it where it is importable, ``asyncio`` keeps the
standard loop (to compare, or where uvloop misbehaves), ``uvloop`` insists on it. `serve` (uvicorn)
and the shards' front (aiohttp) both ask `loop_name`, and log the loop they run on once.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["EVENT_LOOPS", "loop_name", "new_event_loop"]

EVENT_LOOPS = ("auto", "asyncio", "uvloop")

log = logging.getLogger(__name__)


def loop_name(choice: str, server: str = "") -> str:
    """The loop `choice` means here: ``"uvloop"`` or ``"asyncio"``; a one-line error for a bad choice.
    With `server` (what runs on it), one info line says which loop it got."""
    name = _resolve(choice)
    if server:
        log.info("%s: event loop %s (gateway.event_loop %s)", server, name, choice)
    return name


def _resolve(choice: str) -> str:
    if choice not in EVENT_LOOPS:
        raise ValueError(f"gateway.event_loop must be one of {', '.join(EVENT_LOOPS)}; got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "auto":
            return "asyncio"
        raise ValueError(
            "gateway.event_loop is uvloop but uvloop is not importable here: install it or use auto"
        ) from None
    return "uvloop"


def new_event_loop(choice: str, server: str) -> asyncio.AbstractEventLoop:
    """A new loop of `choice` (see `loop_name`), logged once as `server`'s."""
    if loop_name(choice, server) == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
