"""Two real embedded engines behind the real sglang-router (consistent hashing on X-SMG-Routing-Key)."""

from __future__ import annotations

import logging
import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from palaestra.engine.cli import H2_PREFACE, engine_process, http1_protocol
from palaestra.engine.router import RouterProcess
from palaestra.net import wait_http_ok

pytestmark = pytest.mark.engine  # two embedded engines behind the router

COUNTER = "palaestra_engine_http_generate_requests_total"


def _count(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(COUNTER + " "):
            return float(line.split()[1])
    raise AssertionError(f"{COUNTER} missing from {url}/metrics")


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    with (
        engine_process("tiny", extra_args=["--num-threads", "1"]) as e1,
        engine_process("tiny", extra_args=["--num-threads", "1"]) as e2,
        RouterProcess(
            [e1.url, e2.url], router_options=["--router-health-check-interval-secs", "1"]
        ) as router,
    ):
        yield router, [e1, e2]


def test_each_routing_key_lands_on_one_worker(fleet):
    router, engines = fleet
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    placement: dict[str, int] = {}
    with httpx.Client(timeout=60, trust_env=False) as c:
        for k in range(50):
            key = f"session-{k}"
            before = [_count(c, e.url) for e in engines]
            for _ in range(5):
                r = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": key})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["completion_tokens"] == 1
            delta = [_count(c, e.url) - b for e, b in zip(engines, before, strict=True)]
            assert sorted(delta) == [0, 5], f"key {key} was split across workers: {delta}"
            placement[key] = delta.index(5)
        per_worker = [list(placement.values()).count(i) for i in range(2)]
        print(f"keys per worker: {per_worker}")
        assert min(per_worker) > 0, "consistent hashing should spread 50 keys over both workers"
        # no key: still served (by some worker)
        before = sum(_count(c, e.url) for e in engines)
        r = c.post(f"{router.url}/generate", json=body)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1
        assert sum(_count(c, e.url) for e in engines) == before + 1


def test_full_protocol_survives_the_router(fleet):
    """The router re-serialises /generate bodies; logprob fields must still come back intact."""
    router, _ = fleet
    body = {
        "input_ids": [5, 6, 7, 8],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
    }
    with httpx.Client(timeout=60, trust_env=False) as c:
        a = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": "k"}).json()
        b = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": "k"}).json()
    meta = a["meta_info"]
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 3
    assert len(meta["input_token_logprobs"]) == 4 and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_top_logprobs"]) == 3


def test_engines_behind_the_router_log_no_invalid_request(fleet):
    # The router's gRPC detection opens with the HTTP/2 preface; uvicorn warned once per probe.
    _, engines = fleet
    for engine in engines:
        assert "serving tiny" in engine.log_tail()
        assert "Invalid HTTP request" not in engine.log_tail(), engine.log_tail()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_http2_preface_is_closed_quietly_and_other_garbage_still_warns():
    app = FastAPI()
    app.get("/health")(lambda: {})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http1_protocol()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    records = _Records()  # uvicorn's loggers do not propagate to pytest's
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=10)

        def send(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(data)
                return conn.recv(4096)

        assert send(H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00") == b""  # closed, no answer
        assert send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
        assert records.messages == []
        assert send(b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert records.messages == ["Invalid HTTP request received."]
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
        server.should_exit = True
        thread.join(timeout=5)
