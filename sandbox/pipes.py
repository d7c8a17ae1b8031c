"""Non-blocking pipe ends on the asyncio loop: read one into a ``CappedOutput`` as data arrives,
write bytes into another as its reader takes them. The local backend moves every byte of a
command's stdin, stdout and stderr, and of uploads and downloads, through these.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from palaestra.sandbox.output import CappedOutput

__all__ = ["feed", "pump"]


def pump(
    loop: asyncio.AbstractEventLoop, fd: int, sink: CappedOutput, on_over: Callable[[], None]
) -> asyncio.Future:
    """Read ``fd`` into ``sink`` as data arrives; the future resolves at EOF. ``fd`` is closed
    when the future is done (also when it is cancelled)."""
    done = loop.create_future()
    os.set_blocking(fd, False)

    def readable() -> None:
        for _ in range(16):  # drain a burst per wake-up: a flood then costs few loop turns
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                if not done.done():
                    done.set_result(None)
                return
            if sink.feed(chunk):
                on_over()

    def finish(_: asyncio.Future) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    loop.add_reader(fd, readable)
    done.add_done_callback(finish)
    return done


def feed(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> asyncio.Future:
    """Write ``data`` to ``fd`` as the reader takes it, then close ``fd``; cancel to stop early."""
    done = loop.create_future()
    view = memoryview(data)
    os.set_blocking(fd, False)

    def writable() -> None:
        nonlocal view
        try:
            while view:
                view = view[os.write(fd, view[: 1 << 16]) :]
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin: the rest is not wanted
            pass
        if not done.done():
            done.set_result(None)

    def finish(_: object) -> None:
        loop.remove_writer(fd)
        os.close(fd)

    done.add_done_callback(finish)
    if data:
        loop.add_writer(fd, writable)
    else:
        done.set_result(None)
    return done
