"""A server started by ServerProcess does not outlive a parent killed with SIGKILL (issue 37)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from palaestra import lifeline
from tests.support.schedstat import thread_runs

# The server: imports palaestra (as every engine, router and gateway does) and answers /health.
CHILD = textwrap.dedent(
    """
    import http.server, sys
    import palaestra  # noqa: F401  (the import starts the lifeline)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)

# The parent: starts the server through ServerProcess, prints its pid, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import sys, time
    from palaestra.net import ServerProcess, free_port
    port = free_port()
    argv = [sys.executable, "-c", sys.argv[1], str(port)]
    server = ServerProcess(argv, f"http://127.0.0.1:{port}", name="child", free_ports=[])
    server.start()
    print(server.pid, flush=True)
    time.sleep(3600)
    """
)


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def test_a_server_ends_when_its_parent_is_killed_with_sigkill():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = None
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent printed {line!r} instead of its server's pid"
        child = int(line)
        assert _running(child), "the server should run while its parent does"
        # The parent alone, by its pid: its process group holds the server too, which a group kill
        # would end directly and so prove nothing.
        parent.kill()
        parent.wait()
        # The watch polls every POLL_S and then stops the server; the bound is far above that.
        deadline = time.monotonic() + 60
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(child), f"server {child} still runs 60 s after its parent was killed"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)


def test_the_watch_is_not_passed_on_to_the_servers_own_children(monkeypatch):
    monkeypatch.setenv(lifeline.ENV, str(os.getppid()))
    monkeypatch.setattr(lifeline, "_watch", lambda parent, gone: None)  # no thread left in pytest
    assert lifeline.watch_parent_from_env()
    assert lifeline.ENV not in os.environ


@pytest.mark.parametrize("value", ["", "x", "1", "0"])
def test_no_watch_without_a_usable_parent_pid(monkeypatch, value):
    monkeypatch.setenv(lifeline.ENV, value)
    assert not lifeline.watch_parent_from_env()


def test_the_watch_sleeps_on_a_pidfd_until_the_process_exits():
    """No wake-up while the watched process lives (polling woke twice a second), and a wake-up once
    it is killed, before anyone reaps it (a zombie has exited)."""
    import threading

    watched = subprocess.Popen(["sleep", "3600"])
    try:
        thread = threading.Thread(
            target=lifeline._sleep_until_it_exits, args=(watched.pid, lifeline._not_running)
        )
        thread.start()

        def runs() -> int:
            return thread_runs(thread.native_id)

        deadline, last = time.monotonic() + 60, -1
        while runs() != last and time.monotonic() < deadline:  # until it has gone to sleep
            last = runs()
            time.sleep(0.2)
        before = runs()
        time.sleep(1.5)  # polling: 3 wake-ups
        assert thread.is_alive() and runs() - before <= 1
        watched.kill()  # not reaped yet: the thread must wake on the exit itself
        thread.join(timeout=60)
        assert not thread.is_alive(), "the watch did not wake when the process exited"
    finally:
        watched.kill()
        watched.wait()


def test_without_a_pidfd_the_watch_falls_back_to_polling(monkeypatch):
    def refused(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    started = time.monotonic()
    lifeline._sleep_until_it_exits(os.getpid(), lifeline._not_running)  # returns: the poll takes over
    assert time.monotonic() - started < 60
