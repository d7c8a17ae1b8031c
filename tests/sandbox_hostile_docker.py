"""Hostile programs for the container-backed sandboxes (the docker backend, and the compose fleet's
exec servers reached through the remote backend): each must be contained with the right status,
leave no process behind, give back its memory, and leave the sandbox working.

Used by tests/test_sandbox_docker.py and tests/test_compose.py, which supply a sandbox and a
``Probe`` that looks at the containers from the host (``docker top`` and cgroup memory through the
engine, so nothing the hostile code does inside can fake it).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from palaestra.sandbox.base import ExecResult, Sandbox


@dataclass
class Probe:
    """Host-side views of the containers a sandbox runs in."""

    processes: Callable[[], list[str]]
    """Command lines of every process in them."""
    memory_bytes: Callable[[], int]
    """Their memory cgroups' usage."""


async def _wait_settled(probe: Probe, baseline: list[str], settle_s: float = 5.0) -> list[str]:
    """The processes once no more than the baseline remain (or whatever is left after settle_s)."""
    deadline = asyncio.get_running_loop().time() + settle_s
    while True:
        procs = await asyncio.to_thread(probe.processes)
        if len(procs) <= len(baseline) or asyncio.get_running_loop().time() > deadline:
            return procs
        await asyncio.sleep(0.1)


async def fork_bomb(box: Sandbox) -> ExecResult:
    r = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=3)
    assert r.status == "timeout", r.detail
    return r


async def memory_bomb(box: Sandbox) -> ExecResult:
    r = await box.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(16 << 20))"], timeout=20)
    assert r.status == "memory", (r.status, r.detail, r.stderr[-300:])
    return r


async def infinite_loop(box: Sandbox) -> ExecResult:
    r = await box.exec(["python3", "-c", "while True: pass"], timeout=2)
    assert r.status == "timeout", r.detail
    assert r.duration_s < 10
    return r


async def sleep_past_timeout(box: Sandbox) -> ExecResult:
    r = await box.exec(["sleep", "60"], timeout=1.5)
    assert r.status == "timeout" and r.exit_code is not None and r.exit_code < 0, r
    assert 1.4 < r.duration_s < 6, r.duration_s
    return r


async def setsid_child(box: Sandbox) -> ExecResult:
    # The child detaches (new session, stdio closed) and would write a file 2 s after the exec.
    r = await box.exec(
        "setsid sh -c 'sleep 2; echo escaped > late.txt' </dev/null >/dev/null 2>&1 & echo started",
        timeout=10,
    )
    assert r.status == "ok" and r.stdout.strip() == "started", r
    assert r.duration_s < 1.5, "the exec waited for its detached child"
    await asyncio.sleep(3)
    check = await box.exec("test -e late.txt && echo present || echo absent")
    assert check.stdout.strip() == "absent", "a child outlived its exec"
    return r


async def host_loopback(box: Sandbox) -> ExecResult:
    """A server on the host's 127.0.0.1 must be unreachable (and see no connection)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', 'localhost', '192.0.2.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2); print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e.errno)\n"
    )
    try:
        r = await box.exec(["python3", "-c", code], timeout=15)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert r.status == "ok" and "CONNECTED" not in r.stdout and r.stdout.count("refused") == 3, r
    assert not accepted, "the host's loopback server got a connection from the sandbox"
    return r


async def network_interfaces(box: Sandbox) -> ExecResult:
    code = "import socket; print(sorted(n for _, n in socket.if_nameindex()))"
    r = await box.exec(["python3", "-c", code], timeout=10)
    assert r.status == "ok" and r.stdout.strip() == "['lo']", r
    dev = await box.exec("cat /proc/net/dev")
    names = sorted(line.split(":")[0].strip() for line in dev.stdout.splitlines()[2:])
    assert names == ["lo"], names
    return r


async def write_outside_workdir(box: Sandbox) -> ExecResult:
    code = (
        "import os\n"
        "for p in ('/etc/passwd', '/x', '/tmp/x', '/usr/bin/x', '/opt/palaestra/runner.py', '/proc/sys/kernel/x',"
        " '/dev/shm/x', '/dev/mqueue/x', '/dev/x', '/root/x'):\n"
        "    try:\n"
        "        open(p, 'a').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, e.errno)\n"
        "open('/work/inside.txt', 'w').write('ok'); print('inside ok')\n"
    )
    r = await box.exec(["python3", "-c", code], timeout=10)
    assert r.status == "ok" and "WROTE" not in r.stdout and "inside ok" in r.stdout, r.stdout + r.stderr
    return r


async def host_secrets(box: Sandbox) -> ExecResult:
    """Secrets planted in the host's /tmp and home must not be readable, under any path."""
    token = uuid.uuid4().hex
    planted = [Path("/tmp") / f"palaestra-secret-{token[:8]}", Path.home() / f".palaestra-secret-{token[:8]}"]
    for p in planted:
        p.write_text(token)
    # The token is split so that the command line itself (visible in /proc) does not contain it.
    half = len(token) // 2
    code = (
        "import os, sys\n"
        f"needle = ('{token[:half]}' + '{token[half:]}').encode()\n"
        f"for p in {[str(p) for p in planted]!r}:\n"
        "    try: print('READ', p, open(p, 'rb').read() == needle)\n"
        "    except OSError as e: print('missing', p)\n"
        "found = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root in ('/proc', '/sys', '/dev'): dirs[:] = []; continue\n"
        "    for f in files:\n"
        "        try:\n"
        "            if needle in open(os.path.join(root, f), 'rb').read(1 << 20): found.append(f)\n"
        "        except OSError: pass\n"
        "print('found', found)\n"
    )
    try:
        r = await box.exec(["python3", "-c", code], timeout=60)
    finally:
        for p in planted:
            p.unlink()
    assert r.status == "ok" and "READ" not in r.stdout and "found []" in r.stdout, r.stdout + r.stderr[-500:]
    return r


async def stdout_flood(box: Sandbox) -> ExecResult:
    r = await box.exec("head -c 5000000000 /dev/zero", timeout=60)
    assert r.status == "output_limit" and r.stdout_truncated, r.detail
    assert len(r.stdout.encode()) <= box.limits.output_bytes * 2  # a cut may leave U+FFFDs
    assert r.duration_s < 30
    return r


async def disk_fill(box: Sandbox) -> ExecResult:
    """Fill the work dir's tmpfs: the command fails with ENOSPC (status ok, exit != 0), nothing
    else breaks, and removing the files gives the space back."""
    chunk = max(1, box.limits.file_size_mb // 2)
    used = "python3 -c \"import os; s = os.statvfs('/work'); print(s.f_blocks - s.f_bfree)\""
    before = await box.exec(used)
    script = f"i=0; while dd if=/dev/zero of=fill.$i bs=1M count={chunk} 2>/dev/null; do i=$((i+1)); done; df -m /work"
    r = await box.exec(script, timeout=60)
    assert r.status == "ok", r.detail
    assert "100%" in r.stdout, r.stdout
    after = await box.exec(f"rm -f fill.* && {used}")
    assert after.ok and after.stdout == before.stdout, (before.stdout, after.stdout)
    return r


HOSTILE: dict[str, Callable[[Sandbox], Awaitable[ExecResult]]] = {
    "fork_bomb": fork_bomb,
    "memory_bomb": memory_bomb,
    "infinite_loop": infinite_loop,
    "sleep_past_timeout": sleep_past_timeout,
    "setsid_child": setsid_child,
    "host_loopback": host_loopback,
    "network_interfaces": network_interfaces,
    "write_outside_workdir": write_outside_workdir,
    "host_secrets": host_secrets,
    "stdout_flood": stdout_flood,
    "disk_fill": disk_fill,
}


async def run_contained(name: str, box: Sandbox, probe: Probe) -> ExecResult:
    """Run one hostile case, then check the aftermath: no process of it alive, memory back within
    32 MiB of where it was, and the next exec in the same sandbox works."""
    baseline = await asyncio.to_thread(probe.processes)
    memory_before = await asyncio.to_thread(probe.memory_bytes)
    result = await HOSTILE[name](box)
    after = await _wait_settled(probe, baseline)
    assert len(after) <= len(baseline), f"{name} left processes behind: {sorted(set(after) - set(baseline))}"
    memory_after = await asyncio.to_thread(probe.memory_bytes)
    assert memory_after <= memory_before + (32 << 20), (name, memory_before, memory_after)
    nxt = await box.exec(["python3", "-c", "print('alive')"], timeout=20)
    assert nxt.ok and nxt.stdout == "alive\n", (name, nxt)
    return result
