"""palaestra/quiet_server.py: uvicorn's server ticking once a second, stopped at once by should_exit.

The stop tests set the tick to an hour: a server that waited for its next tick to see `should_exit`
would not stop within the join's minute, however fast or slow this machine is."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from palaestra import quiet_server
from palaestra.net import free_port
from tests.support.schedstat import thread_runs


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    return app


def _started(server: quiet_server.QuietServer) -> threading.Thread:
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return thread


def _server(port: int) -> quiet_server.QuietServer:
    return quiet_server.QuietServer(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning"))


@pytest.mark.parametrize("how", ["attribute", "signal handler"])
def test_stops_as_soon_as_asked_not_at_the_next_tick(monkeypatch, how):
    monkeypatch.setattr(quiet_server, "TICK_S", 3600.0)
    port = free_port()
    server = _server(port)
    thread = _started(server)
    answer = httpx.get(f"http://127.0.0.1:{port}/ping", trust_env=False, timeout=30)
    assert answer.json() == {"ok": True} and answer.headers["date"].endswith("GMT")
    if how == "attribute":  # as a test's ThreadServer stops its server
        server.should_exit = True
    else:  # what uvicorn's SIGTERM handler runs (called here: a signal would reach pytest's thread)
        server.handle_exit(signal.SIGTERM, None)
        server._captured_signals.clear()  # not raised again at the end of run(): we are not serving
    thread.join(timeout=60)
    assert not thread.is_alive(), "the server waited for its next tick (an hour) to stop"


def test_an_idle_server_wakes_about_once_a_second():
    """Counted, not timed: the serving thread's runs in 1.5 s (schedstat's third field). uvicorn's
    own server runs it at least 15 times (a 0.1 s tick); this one 1-2 ticks plus the start's tail."""
    server = _server(free_port())
    thread = _started(server)
    time.sleep(0.5)  # the start's last steps
    before = thread_runs(thread.native_id)
    time.sleep(1.5)
    woken = thread_runs(thread.native_id) - before
    server.should_exit = True
    thread.join(timeout=60)
    assert woken <= 6, woken


def test_run_exits_with_uvicorns_status_when_the_port_is_taken():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as exited:
            quiet_server.run(_app(), host="127.0.0.1", port=taken.getsockname()[1], log_level="critical")
    assert exited.value.code == 3
