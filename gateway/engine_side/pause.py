"""`PauseGate`: the drain control of a weight sync. While paused, new generation calls wait (up to
`pause_wait_s`) or get 429 (`pause_mode: reject`); calls in flight finish, and `drained` says when
none is left. `pauses` counts the pauses, so a call can tell whether one began while it ran (an
engine call a weight update interrupted then waits in `reenter` and continues: gateway/engine_side/partial.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from palaestra.gateway.errors import GatewayError

if TYPE_CHECKING:
    from palaestra.gateway.config import GatewayConfig
    from palaestra.gateway.metrics import GatewayMetrics

__all__ = ["PauseGate"]


class PauseGate:
    """Drain control: while paused, new generation calls wait (bounded) or get 429; in-flight ones finish."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics):
        self.config = config
        self.metrics = metrics
        self._open = asyncio.Event()
        self._open.set()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.pauses = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        if not self.paused:
            self.pauses += 1
        self._open.clear()
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self._open.set()
        self.metrics.paused.set(0)

    async def drained(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def enter(self) -> None:
        if self.paused:
            if self.config.pause_mode == "reject":
                raise GatewayError(
                    "generation is paused for a weight update; retry shortly",
                    429,
                    type="rate_limit_error",
                    code="paused",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                )
            try:
                await asyncio.wait_for(self._open.wait(), self.config.pause_wait_s)
            except TimeoutError:
                raise GatewayError(
                    f"generation stayed paused for {self.config.pause_wait_s:g} s",
                    503,
                    type="server_error",
                    code="paused_too_long",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                ) from None
        self.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    async def reenter(self) -> None:
        """A call in flight whose engine call a weight update interrupted: not counted in flight
        while it waits for the gate to open again (bounded by `pause_wait_s`; never 429: it was
        admitted before the pause), then counted again. Raises 503 when the pause outlasts the wait."""
        self.leave()
        try:
            await asyncio.wait_for(self._open.wait(), self.config.pause_wait_s)
        except TimeoutError:
            raise GatewayError(
                f"generation stayed paused for {self.config.pause_wait_s:g} s (a call interrupted by "
                "a weight update was waiting to continue)",
                503,
                type="server_error",
                code="paused_too_long",
                headers={"Retry-After": str(self.config.retry_after_s)},
            ) from None
        finally:  # counted again either way: the caller's `leave` follows
            self.in_flight += 1
            self._idle.clear()
            self.metrics.in_flight.set(self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()
