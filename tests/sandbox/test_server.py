"""The exec server's HTTP surface: the API key on every route, bad input answered 400 with the
field named, limits on requests and sandboxes, and a server that keeps serving through all of it."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys

import httpx
import pytest

from palaestra.sandbox import ExecServer, LocalBackend
from tests.support.sandbox import TEST_LABEL, exec_server

KEY = secrets.token_hex(16)


@pytest.fixture(scope="module")
def server():
    with exec_server(KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def sandbox_id(client):
    sid = client.post("/v1/sandboxes", json={"limits": {"memory_mb": 128}, "label": TEST_LABEL}).json()["id"]
    yield sid
    client.delete(f"/v1/sandboxes/{sid}")


ROUTES = [
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes/x/exec"),
    ("PUT", "/v1/sandboxes/x/files?path=a"),
    ("GET", "/v1/sandboxes/x/files?path=a"),
    ("GET", "/v1/sandboxes/x/alive"),
    ("POST", "/v1/sandboxes/x/reset"),
    ("DELETE", "/v1/sandboxes/x"),
    ("POST", "/v1/cleanup"),
]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_needs_the_key(server, method, path):
    with httpx.Client(base_url=server.url, trust_env=False) as anonymous:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"X-API-Key": KEY[:-1]},
            {"Authorization": KEY},
        ):
            response = anonymous.request(method, path, headers=headers)
            assert response.status_code == 401, (headers, response.text)
            assert "API key" in response.json()["error"]


def test_health_is_open_and_the_other_key_header_works(server, sandbox_id):
    with httpx.Client(base_url=server.url, trust_env=False) as anonymous:
        assert anonymous.get("/health").json()["ok"] is True
        alive = anonymous.get(f"/v1/sandboxes/{sandbox_id}/alive", headers={"X-API-Key": KEY})
    assert alive.json() == {"alive": True}


@pytest.mark.parametrize(
    "body,field",
    [
        ({"limits": {"memory_mb": -1}}, "memory_mb"),
        ({"limits": {"memory": 5}}, "memory"),
        ({"limits": [1]}, "limits"),
        ({"limit": {}}, "limit"),
        ({"profile": "cobol"}, "cobol"),
        ({"label": 3}, "label"),
    ],
)
def test_bad_create_requests_name_the_field(client, body, field):
    response = client.post("/v1/sandboxes", json=body)
    assert response.status_code == 400 and field in response.json()["error"], response.text


@pytest.mark.parametrize(
    "body,field",
    [
        ({"cmd": ["true"], "timeout": "soon"}, "timeout"),
        ({"cmd": ["true"], "timeout": -2}, "timeout"),
        ({"cmd": []}, "cmd"),
        ({"cmd": [1, 2]}, "cmd"),
        ({}, "cmd"),
        ({"cmd": ["true"], "env": {}}, "env"),
        ({"cmd": ["cat"], "stdin_b64": "%%%"}, "stdin_b64"),
        ({"cmd": ["cat"], "stdin": 5}, "stdin"),
    ],
)
def test_bad_exec_requests_name_the_field(client, sandbox_id, body, field):
    response = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json=body)
    assert response.status_code == 400 and field in response.json()["error"], response.text


def test_bad_file_requests_and_unknown_things(client, sandbox_id):
    assert "'path'" in client.put(f"/v1/sandboxes/{sandbox_id}/files", content=b"x").json()["error"]
    traversal = client.put(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "../x"}, content=b"x")
    assert traversal.status_code == 400 and "'path'" in traversal.json()["error"]
    missing = client.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "nope"})
    assert missing.status_code == 404
    assert client.post("/v1/sandboxes/no-such-id/exec", json={"cmd": ["true"]}).status_code == 404
    assert client.get("/v1/nothing-here").status_code == 404
    assert client.patch(f"/v1/sandboxes/{sandbox_id}/exec").status_code == 405
    assert client.delete("/v1/sandboxes/no-such-id").status_code == 204  # closing is idempotent
    assert client.post("/v1/cleanup", json={"label": ""}).status_code == 400
    not_json = client.post(f"/v1/sandboxes/{sandbox_id}/exec", content=b"{not json")
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]


def _raw(server, data: bytes) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_http_is_refused_and_the_server_keeps_serving(server, client, sandbox_id):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    answers = [
        _raw(server, b"GARBAGE\r\n\r\n"),
        _raw(
            server, b"POST /v1/sandboxes HTTP/1.1\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        ),
        _raw(
            server,
            b"PUT /v1/sandboxes/x/files?path=a HTTP/1.1\r\n" + auth + b"Content-Length: 99999999999\r\n\r\n",
        ),
        _raw(server, b"GET /health HTTP/1.1\r\nContent-Length: minus\r\n\r\n"),
        _raw(server, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"),
    ]
    statuses = [a.split(b" ", 2)[1] for a in answers]
    assert statuses == [b"400", b"411", b"413", b"400", b"431"], answers
    result = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": ["echo", "still serving"]})
    assert result.json()["stdout"] == "still serving\n"


def test_exec_answers_an_exec_result(client, sandbox_id):
    import base64

    body = {"cmd": ["cat"], "stdin_b64": base64.b64encode(b"in").decode(), "timeout": 5}
    data = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json=body).json()
    assert data["status"] == "ok" and data["stdout"] == "in" and data["exit_code"] == 0
    assert set(data) >= {"status", "exit_code", "stdout", "stderr", "stdout_truncated", "duration_s"}


def test_serve_refuses_to_start_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "PALAESTRA_SANDBOX_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "palaestra.sandbox", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "API key is required" in done.stderr


def test_sandbox_count_is_capped(loop_runner):
    async def go():
        server = ExecServer(LocalBackend(label=TEST_LABEL), "k", max_sandboxes=1)
        host, port = await server.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(
                base_url=f"http://{host}:{port}", headers={"X-API-Key": "k"}, trust_env=False
            ) as c:
                first = await c.post("/v1/sandboxes", json={})
                second = await c.post("/v1/sandboxes", json={})
                listing = await c.get("/v1/sandboxes")
        finally:
            await server.close()
        return first.status_code, second.status_code, json.loads(second.text), listing.json()

    first, second, body, listing = loop_runner.run(go())
    assert (first, second) == (201, 503) and "maximum of 1" in body["error"]
    assert len(listing) == 1
