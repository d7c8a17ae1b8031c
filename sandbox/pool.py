"""A warm pool of sandboxes over any backend.

    pool = await SandboxPool(LocalBackend(), size=8, limits=Limits(memory_mb=256)).start()
    async with pool.sandbox() as box:            # waits while all `size` sandboxes are in use
        result = await box.exec(["python3", "solution.py"])
    await pool.close()

``start()`` first removes sandboxes that an earlier, crashed process left behind under the
backend's label (``Backend.cleanup_leaked``), then creates ``size`` sandboxes. ``acquire()`` checks
that a sandbox is alive before handing it out and replaces a dead one; ``release()`` empties its
work directory and /tmp (``Sandbox.reset``) so the next user starts clean, or, if that fails,
closes it and creates a replacement in the background. No sandbox is ever shared by two users at
once; the pool never holds more than ``size``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from palaestra.sandbox.base import Backend, Limits, Sandbox, SandboxError

__all__ = ["SandboxPool"]


class SandboxPool:
    """At most ``size`` sandboxes of one profile and limits, kept warm between users."""

    def __init__(
        self,
        backend: Backend,
        size: int,
        *,
        profile: str = "python",
        limits: Limits | None = None,
        cleanup_on_start: bool = True,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"'size' must be a positive integer; got {size!r}")
        self.backend = backend
        self.size = size
        self.profile = profile
        self.limits = limits or Limits()
        self.cleanup_on_start = cleanup_on_start
        self.leaked_removed = 0
        """Sandboxes of earlier processes that ``start()`` removed."""
        self.replaced = 0
        """Sandboxes found dead (or failing to reset) and replaced."""
        self._idle: list[Sandbox] = []
        self._busy: set[Sandbox] = set()
        self._count = 0  # idle + busy + being created
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> SandboxPool:
        if self.cleanup_on_start:
            self.leaked_removed = await self.backend.cleanup_leaked()
        self._count = self.size
        created = await asyncio.gather(*(self._create() for _ in range(self.size)), return_exceptions=True)
        errors = [c for c in created if isinstance(c, BaseException)]
        self._idle.extend(c for c in created if not isinstance(c, BaseException))
        if errors:
            await self.close()
            raise SandboxError(f"pool start: {len(errors)} of {self.size} sandboxes failed: {errors[0]}")
        return self

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def busy(self) -> int:
        return len(self._busy)

    async def acquire(self) -> Sandbox:
        """A live sandbox for one user; waits while all are in use."""
        while True:
            async with self._cond:
                self._check_open()
                while not self._idle and self._count >= self.size:
                    await self._cond.wait()
                    self._check_open()
                box = self._idle.pop() if self._idle else None
                if box is None:
                    self._count += 1
            if box is None:
                try:
                    box = await self._create()
                except BaseException:
                    await self._forget_one()
                    raise
                self._busy.add(box)
                return box
            if await box.alive():
                self._busy.add(box)
                return box
            # Dead while idle (killed, host restarted...): close it and make a new one in its place.
            self.replaced += 1
            with contextlib.suppress(Exception):
                await box.close()
            try:
                box = await self._create()
            except BaseException:
                await self._forget_one()
                raise
            self._busy.add(box)
            return box

    async def release(self, box: Sandbox) -> None:
        """Give a sandbox back: reset for the next user, or replaced if it cannot be."""
        self._busy.discard(box)
        try:
            if self._closed:
                raise SandboxError("pool closed")
            await box.reset()
        except (SandboxError, OSError):
            with contextlib.suppress(Exception):
                await box.close()
            if not self._closed:
                self.replaced += 1
                self._spawn(self._refill_one())
            else:
                await self._forget_one()
            return
        async with self._cond:
            self._idle.append(box)
            self._cond.notify()

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        box = await self.acquire()
        try:
            yield box
        finally:
            await self.release(box)

    async def close(self) -> None:
        """Close every sandbox, idle or in use. Idempotent."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        boxes = [*self._idle, *self._busy]
        self._idle.clear()
        self._busy.clear()
        await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
        async with self._cond:
            self._cond.notify_all()

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")

    async def _create(self) -> Sandbox:
        return await self.backend.create(self.profile, self.limits)

    async def _refill_one(self) -> None:
        """Replace a sandbox that was closed on release (keeps the pool warm)."""
        try:
            box = await self._create()
        except Exception:
            await self._forget_one()  # acquire() will try again when someone needs one
            return
        if self._closed:
            await box.close()
            return
        async with self._cond:
            self._idle.append(box)
            self._cond.notify()

    async def _forget_one(self) -> None:
        async with self._cond:
            self._count -= 1
            self._cond.notify()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
