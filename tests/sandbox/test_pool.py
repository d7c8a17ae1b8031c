"""The warm pool on every backend: the size limit, a dead sandbox replaced before it is handed out,
a broken one replaced after use, and start-up removal of sandboxes a crashed owner left behind."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from palaestra.sandbox import Limits, LocalBackend, SandboxPool
from palaestra.sandbox.cgroups import CgroupHost
from palaestra.sandbox.docker import DockerSandbox
from palaestra.sandbox.local import LocalSandbox
from palaestra.sandbox.remote import RemoteBackend, RemoteSandbox
from tests.support.sandbox import exec_server

LIMITS = Limits(timeout_s=10, memory_mb=256)


async def kill_from_outside(box) -> None:
    """End a sandbox the way a crash would, behind the pool's back."""
    if isinstance(box, LocalSandbox):
        os.kill(box.pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
    elif isinstance(box, RemoteSandbox):  # another client (or the idle reaper) closed it on the server
        await box.backend.request("DELETE", f"/v1/sandboxes/{box.id}")
    elif isinstance(box, DockerSandbox):  # the container dies (docker kill of its PID 1)
        await asyncio.to_thread(box.container.kill)
    else:
        pytest.skip(f"this test has no way yet to kill a {type(box).__name__} from outside")


def test_size_limit_makes_the_next_user_wait(sandbox_backend, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        async with SandboxPool(backend, size=2, limits=LIMITS) as pool:
            first, second = await pool.acquire(), await pool.acquire()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.acquire(), 0.5)
            waiter = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0.1)
            assert not waiter.done()
            await pool.release(first)
            third = await asyncio.wait_for(waiter, 10)
            counts = (pool.idle, pool.busy)
            await pool.release(second)
            await pool.release(third)
        await backend.close()
        return counts

    assert loop_runner.run(go()) == (0, 2)


def test_dead_sandbox_is_replaced_before_it_is_handed_out(sandbox_backend, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        async with SandboxPool(backend, size=1, limits=LIMITS) as pool:
            async with pool.sandbox() as box:
                first_id = box.id
            await kill_from_outside(box)
            async with pool.sandbox() as box:
                result = await box.exec(["echo", "fresh"])
                second_id = box.id
            replaced = pool.replaced
        await backend.close()
        return first_id, second_id, result, replaced

    first_id, second_id, result, replaced = loop_runner.run(go())
    assert first_id != second_id and replaced == 1
    assert result.ok and result.stdout == "fresh\n"


def test_sandbox_broken_during_use_is_replaced_on_release(sandbox_backend, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        async with SandboxPool(backend, size=1, limits=LIMITS) as pool:
            box = await pool.acquire()
            await kill_from_outside(box)
            await pool.release(box)  # reset fails: closed, a replacement is made in the background
            async with pool.sandbox() as again:
                result = await again.exec(["echo", "ok"])
            replaced = pool.replaced
        await backend.close()
        return result, replaced

    result, replaced = loop_runner.run(go())
    assert result.stdout == "ok\n" and replaced == 1


def test_local_pool_start_removes_what_a_killed_owner_left(loop_runner):
    """A process holding two sandboxes is SIGKILLed: bubblewrap's --die-with-parent takes their
    processes down with it; their cgroups (where the host gives sandboxes cgroups) stay behind until
    the next pool with the same label starts."""
    label = f"leak-test-{secrets.token_hex(4)}"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import asyncio, sys
                from palaestra.sandbox import LocalBackend
                async def main():
                    backend = LocalBackend(label={label!r})
                    boxes = [await backend.create() for _ in range(2)]
                    print(" ".join(str(b.pid) for b in boxes), flush=True)
                    await asyncio.sleep(600)
                asyncio.run(main())
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
    finally:
        owner.kill()
        owner.wait()
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "sandboxes outlived their owner"

    host, why = CgroupHost.detect()
    leaked = sorted(n for n in host.names() if n.startswith(label + ".")) if host else []

    async def go():
        backend = LocalBackend(label=label)
        async with SandboxPool(backend, size=1, limits=LIMITS) as pool:
            removed = pool.leaked_removed
            result = await (await pool.acquire()).exec(["true"])
        return removed, result

    removed, result = loop_runner.run(go())
    assert result.ok
    if host is None:
        pytest.skip(f"no sandbox cgroups on this host ({why}): nothing else to leak, processes checked")
    assert len(leaked) == 2 and removed == 2, (leaked, removed)
    assert not any(n.startswith(label + ".") for n in host.names())


def test_remote_pool_start_removes_sandboxes_of_a_vanished_client(loop_runner):
    key = secrets.token_hex(8)
    label = f"leak-test-{secrets.token_hex(4)}"

    async def go(url):
        gone = RemoteBackend(url=url, api_key=key, label=label)
        for _ in range(2):
            await gone.create("python", LIMITS)  # never closed: its client "crashes"
        await gone.close()
        unrelated = RemoteBackend(url=url, api_key=key, label="another-label")
        kept = await unrelated.create("python", LIMITS)
        fresh = RemoteBackend(url=url, api_key=key, label=label, leak_after_s=0)
        async with SandboxPool(fresh, size=1, limits=LIMITS) as pool:
            removed = pool.leaked_removed
            listing = (await fresh.request("GET", "/v1/sandboxes")).json()
        kept_alive = await kept.alive()
        await kept.close()
        await unrelated.close()
        await fresh.close()
        return removed, listing, kept_alive

    with exec_server(key) as server:
        removed, listing, kept_alive = loop_runner.run(go(server.url))
    assert removed == 2
    assert sorted(e["label"] for e in listing) == ["another-label", label]
    assert kept_alive
