"""uvicorn's server, woken once a second instead of ten times while it waits.

`uvicorn.Server.main_loop` sleeps 0.1 s between ticks for its whole life: each tick refreshes the
`date` header once in ten and looks at `should_exit`. On this machine's virtual CPUs a timer wake-up
costs a process ~0.15 ms of CPU, so an idle engine or gateway spent 1.4-2.1 ms of CPU a second on
ticks alone, and a gateway serving a harness at ~3 turns a second paid ~0.5 ms of it per turn
(docs/gateway.md, "Idle wake-ups"). `QuietServer` ticks once a second (the `date` header still
changes every second) and wakes at once when `should_exit` is set, by a signal (`handle_exit`) or by
code (a test's `ThreadServer`), so stopping is no slower.

    run(app, host=..., port=..., ...)   # `uvicorn.run`'s keyword arguments, one worker, no reload
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import uvicorn

__all__ = ["TICK_S", "QuietServer", "run"]

TICK_S = 1.0
"""Seconds between ticks: the `date` header's resolution, as uvicorn's."""

_STARTUP_FAILURE = 3  # uvicorn.run's exit status when the server could not start


class QuietServer(uvicorn.Server):
    """`uvicorn.Server` with a tick a second, woken by `should_exit` (module doc)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._should_exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, event = self._loop, self._exit_event
        if value and loop is not None and event is not None:
            try:  # from a signal handler, another thread or the loop itself
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: main_loop has returned
                pass

    async def main_loop(self) -> None:
        self._loop, self._exit_event = asyncio.get_running_loop(), asyncio.Event()
        # counter 0 every tick: on_tick refreshes the date header each time (it does so at multiples
        # of 10 of uvicorn's 0.1 s ticks), then answers should_exit and the request limit
        while not await self.on_tick(0):
            try:
                await asyncio.wait_for(self._exit_event.wait(), TICK_S)
            except TimeoutError:
                pass


def run(app: Any, **kwargs: Any) -> None:
    """`uvicorn.run(app, **kwargs)` on a `QuietServer` (one worker, no reload): exits with uvicorn's
    start-up failure status when the server could not start (e.g. its port was taken)."""
    server = QuietServer(uvicorn.Config(app, **kwargs))
    server.run()
    if not server.started:
        sys.exit(_STARTUP_FAILURE)
