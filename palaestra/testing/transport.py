"""A stand-in for an asyncio transport, for feeding an HTTP server protocol by hand (benchmarks and
tests of `gateway/http_writes.py`): what is written goes nowhere, reading never pauses, and the
peer and the socket are loopback addresses. Subclass it to keep what is written."""

from __future__ import annotations

from typing import Any

__all__ = ["StandInTransport"]


class StandInTransport:
    """TEST DOUBLE of an asyncio transport (module doc)."""

    def write(self, data: Any) -> None:
        pass

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1234), "sockname": ("127.0.0.1", 8000)}.get(name, default)
