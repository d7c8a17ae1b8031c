"""The compose fleet's front (sandbox/front.py) and the exec server's unix-socket mode, on the host
without docker: two real exec servers (local backend) on unix sockets, the real front on loopback,
the remote backend as the client. (tests/sandbox/test_compose.py runs the same inside containers.)"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import pytest

from palaestra.net import ServerProcess, free_port
from palaestra.sandbox.base import Limits, SandboxError
from palaestra.sandbox.remote import RemoteBackend

LABEL = "palaestra-test-front"


def replica(path: str, key: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "palaestra.sandbox", "serve", "--uds", path, "--label", LABEL]
    proc = subprocess.Popen(
        argv, env={**os.environ, "PALAESTRA_SANDBOX_API_KEY": key}, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the exec server did not start"
        time.sleep(0.05)
    return proc


def replica_ids(path: str, key: str) -> list[str]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://replica") as client:
        answer = client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
    answer.raise_for_status()
    return sorted(s["id"] for s in answer.json())


@pytest.fixture
def fleet(tmp_path):
    key = secrets.token_hex(8)
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    paths = [str(sockets / f"r{i}.sock") for i in range(2)]
    procs = [replica(p, key) for p in paths]
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "palaestra.sandbox.front",
        "--listen",
        f"127.0.0.1:{port}",
        "--sockets",
        str(sockets),
    ]
    try:
        with ServerProcess(argv, f"http://127.0.0.1:{port}", name="sandbox-front") as front:
            yield front.url, key, paths, procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)


def test_front_spreads_routes_and_forgets(fleet):
    url, key, paths, procs = fleet

    async def go():
        backend = RemoteBackend(url=url, api_key=key, label=LABEL)
        boxes = [await backend.create("python", Limits(memory_mb=128)) for _ in range(4)]
        outs = await asyncio.gather(
            *(b.exec(["sh", "-c", f"echo {i} > n; cat n"]) for i, b in enumerate(boxes))
        )
        assert [o.stdout for o in outs] == [f"{i}\n" for i in range(4)]
        held = [replica_ids(p, key) for p in paths]
        assert [len(h) for h in held] == [2, 2], held  # the least-loaded replica gets each create
        listed = (await backend.request("GET", "/v1/sandboxes")).json()  # merged over replicas
        assert sorted(s["id"] for s in listed) == sorted(held[0] + held[1])
        await boxes[0].close()
        health = httpx.get(f"{url}/health").json()
        assert health == {"ok": True, "replicas": 2, "sandboxes": 3}
        with pytest.raises(SandboxError, match="no sandbox"):
            await backend.request("GET", "/v1/sandboxes/not-an-id/alive")
        wrong = RemoteBackend(url=url, api_key="wrong", label=LABEL)
        with pytest.raises(SandboxError, match="API key"):
            await wrong.create("python")
        await wrong.close()

        # A replica dies (its socket file stays behind): its sandboxes fail with an error, new
        # ones go to the other replica.
        dead = next(i for i, h in enumerate(held) if boxes[1].id not in h)
        procs[dead].kill()
        procs[dead].wait()
        on_dead = next(b for b in boxes[1:] if b.id in held[dead])
        with pytest.raises(SandboxError):
            await on_dead.exec(["true"])
        fresh = await backend.create("python", Limits(memory_mb=128))
        assert fresh.id in replica_ids(paths[1 - dead], key)
        assert (await fresh.exec(["echo", "ok"])).stdout == "ok\n"
        for b in [*boxes[1:], fresh]:
            if b is not on_dead:
                await b.close()
        await backend.close()

    asyncio.run(go())
