"""`Waiter.call`: the driver's HTTP calls to a server, supervised like its waits (no Ray started).

A real HTTP server on loopback that is down, then started by the liveness check (the check is a
TEST DOUBLE of `supervisor.Supervisor.check_alive`: it "restarts" the server by starting it), one
that answers 401, and one that never comes up.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from palaestra.net import free_port
from palaestra.orchestrator.errors import RunFailed, StepTimeout
from palaestra.orchestrator.waiting import Waiter


class Answer(BaseHTTPRequestHandler):
    status = 200

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b'{"acked": true}' if self.status == 200 else b"wrong key")

    def log_message(self, *args) -> None:
        pass


class RestartsTheServer:
    """TEST DOUBLE of the supervisor: its check finds the server dead and starts it."""

    def __init__(self, port: int, status: int = 200):
        self.port, self.status, self.checks, self.server = port, status, [], None

    def check_alive(self, phase: str) -> bool:
        self.checks.append(phase)
        if self.server is None:
            handler = type("H", (Answer,), {"status": self.status})
            self.server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
            return True
        return False

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def ack(port: int) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/samples/ack", json={"cursor": 3}, timeout=5, trust_env=False)
    r.raise_for_status()
    return r.json()


def test_a_call_to_a_dead_server_has_it_restarted_and_is_made_again():
    port = free_port()
    watched = RestartsTheServer(port)
    try:
        waiter = Waiter(watched, timeout_s=30, poll_s=0.2)
        waiter.begin("checkpoint step-000002")
        assert waiter.call(lambda: ack(port), "acknowledging the cursor") == {"acked": True}
        assert watched.checks[0] == "acknowledging the cursor"  # the failed call had the servers checked
    finally:
        watched.close()


def test_a_4xx_answer_fails_the_run_at_once_with_the_answer():
    port = free_port()
    watched = RestartsTheServer(port, status=401)
    try:
        watched.check_alive("up")
        waiter = Waiter(watched, timeout_s=30, poll_s=0.2)
        waiter.begin("checkpoint step-000002")
        with pytest.raises(
            RunFailed, match=r"checkpoint step-000002, acking: POST .*/samples/ack answered 401: wrong key"
        ):
            waiter.call(lambda: ack(port), "acking")
    finally:
        watched.close()


def test_a_server_that_never_answers_ends_at_the_deadline_naming_the_phase_and_the_error():
    class NothingDies:  # TEST DOUBLE: the check finds nothing dead (the server just never listens)
        def check_alive(self, phase: str) -> bool:
            return False

    port = free_port()
    waiter = Waiter(NothingDies(), timeout_s=1.0, poll_s=0.2)
    waiter.begin("the run's result")
    with pytest.raises(
        StepTimeout, match=r"the run's result exceeded run.step_timeout_s=1 s during reading .*ConnectError"
    ):
        waiter.call(lambda: ack(port), "reading the versions")


class GaveUp(Exception):
    """What a client with retries of its own raises (as `WeightSyncError` does)."""


def test_a_client_that_gave_up_is_called_again_only_after_a_restart():
    port = free_port()
    watched = RestartsTheServer(port)
    waiter = Waiter(watched, timeout_s=30, poll_s=0.2)
    waiter.begin("the run's result")

    def read() -> dict:
        try:
            return ack(port)
        except httpx.HTTPError as exc:
            raise GaveUp(f"no answer: {exc}") from exc

    try:
        assert waiter.call(read, "reading the versions", unreachable=(GaveUp,)) == {"acked": True}

        def refused() -> dict:  # the server is up (nothing to restart): the error is the answer
            raise GaveUp("no weight_version in the answer")

        with pytest.raises(RunFailed, match=r"the run's result, reading the versions: no weight_version"):
            waiter.call(refused, "reading the versions", unreachable=(GaveUp,))
    finally:
        watched.close()


class RepairsDuringTheCall:
    """TEST DOUBLE of the supervisor: its first check (while the call runs) restarts a dead
    engine; later checks find everything alive."""

    def __init__(self):
        self.checks = 0

    def check_alive(self, phase: str) -> bool:
        self.checks += 1
        return self.checks == 1


def test_a_call_that_fails_after_a_restart_during_it_is_made_again(monkeypatch):
    """The chaos soak's failure: an engine killed inside a weight sync was restarted (with the new
    weights) by a liveness check while the sync still ran; the sync then failed on it, and the
    check after the failure found nothing left to repair, so the run stopped. A restart during the
    call counts: the call is made again. Ray's wait and get are TEST DOUBLES (no Ray started)."""
    import ray

    waits = iter([([], ["first"]), (["first"], []), (["again"], [])])
    monkeypatch.setattr(ray, "wait", lambda pending, num_returns, timeout: next(waits))

    def get(refs):
        if refs == ["first"]:
            raise ray.exceptions.RayError("engine http://127.0.0.1:1: update 1/1 failed after 3 attempts")
        return ["synced"]

    monkeypatch.setattr(ray, "get", get)
    calls = []
    waiter = Waiter(RepairsDuringTheCall(), timeout_s=60, poll_s=0.01)
    assert waiter.get(["first"], "weight sync", again=lambda: calls.append(1) or ["again"]) == ["synced"]
    assert calls == [1]


def test_a_call_that_fails_with_nothing_restarted_fails_the_run(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "wait", lambda pending, num_returns, timeout: (list(pending), []))
    monkeypatch.setattr(ray, "get", lambda refs: (_ for _ in ()).throw(ray.exceptions.RayError("boom")))

    class NothingDied:
        def check_alive(self, phase: str) -> bool:
            return False

    with pytest.raises(RunFailed, match="weight sync: boom"):
        Waiter(NothingDied(), timeout_s=60, poll_s=0.01).get(["first"], "weight sync", again=lambda: ["x"])
