"""A server that `ServerProcess` started ends when the process that started it is gone.

A parent killed with SIGKILL runs no clean-up, and Linux hands its children to init, where an
engine or a gateway would run on, holding its port and memory, until someone finds it. So
`ServerProcess` passes its own pid to the child in `PALAESTRA_PARENT_PID`; a child that imports
`palaestra` (every engine, router and gateway we launch does) starts a daemon thread that sleeps on
a pidfd of that parent until it exits (polling `getppid()` every `POLL_S` where there is no pidfd)
and, once the parent it was given is no longer its parent, sends itself SIGTERM (the server's own
clean shutdown) and SIGKILL after `GRACE_S`.

Why not `prctl(PR_SET_PDEATHSIG)`: it fires when the *thread* that forked the child ends, and
servers are started from worker threads (Ray actors, `asyncio.to_thread`), so it would stop servers
whose parent lives on. Real SGLang servers do not import palaestra and are not watched this way.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable

ENV = "PALAESTRA_PARENT_PID"
POLL_S = 0.5  # how often the child looks at its parent
GRACE_S = 10.0  # SIGTERM to SIGKILL, as ServerProcess.stop gives a clean shutdown


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this process named as the parent the child must outlive no longer."""
    return {**env, ENV: str(os.getpid())}


def watch_parent_from_env() -> bool:
    """Starts the watch when this process was started by a `ServerProcess`; whether it did.

    The variable is removed from this process's environment so that the server's own children
    are not told to watch a process that did not start them. Where a wrapper stands between the
    two (a shell, `timeout`), the named process is watched by its pid instead of as our parent."""
    value = os.environ.pop(ENV, None)
    if not value:
        return False
    try:
        parent = int(value)
    except ValueError:
        return False
    if parent <= 1:
        return False
    gone = _not_our_parent if os.getppid() == parent else _not_running
    threading.Thread(target=_watch, args=(parent, gone), name="palaestra-lifeline", daemon=True).start()
    return True


def _sleep_until_it_exits(parent: int, gone: Callable[[int], bool]) -> None:
    """Sleeps on a pidfd of `parent` until it exits, where the kernel gives one (Linux 5.3+): no
    wake-up at all while it lives, where polling woke the process twice a second (~0.2 ms of CPU a
    second here, in every engine and gateway; docs/gateway.md, "Idle wake-ups"). Returns at once
    without one; the caller's poll then confirms `gone`. The fd is opened before `gone` is asked,
    so an exit between the two still wakes it."""
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd here, or the process is already gone
        return
    try:
        if not gone(parent):
            select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def _not_our_parent(pid: int) -> bool:
    return os.getppid() != pid


def _not_running(pid: int) -> bool:
    """Whether `pid` is gone or a zombie (killed, not yet reaped by its own parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _watch(parent: int, gone: Callable[[int], bool]) -> None:
    _sleep_until_it_exits(parent, gone)
    while not gone(parent):
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
