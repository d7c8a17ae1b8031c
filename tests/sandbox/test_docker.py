"""The docker backend against a real docker engine: the container's lockdown, files, leak cleanup,
the runtime passthrough and the offline image build. (The hostile programs, the interface and the
pool run on it through tests/support/sandbox.py's backend registry.)

Needs a docker engine (``.ci/run`` starts one when it runs as root); without one every test here
skips and says why in the summary (``-ra``).
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from palaestra.sandbox.base import Limits, SandboxError
from tests.support.docker import require_engine

pytestmark = pytest.mark.docker

LIMITS = Limits(
    timeout_s=10, cpu_s=20, memory_mb=256, pids=64, workdir_mb=64, file_size_mb=32, output_bytes=1 << 16
)


@pytest.fixture(scope="module")
def docker_client():
    client = require_engine()
    yield client
    client.close()


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def backend(docker_client, runner):
    from palaestra.sandbox.docker import DockerBackend

    b = DockerBackend(label="palaestra-test-docker")
    yield b
    runner.run(b.close())


@pytest.fixture(scope="module")
def box(backend, runner):
    """One warm sandbox shared by the tests below."""
    sandbox = runner.run(backend.create("python", LIMITS))
    yield sandbox
    runner.run(sandbox.close())


def test_container_is_locked_down(docker_client, box, runner):
    host = docker_client.api.inspect_container(box.container.id)["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["PidsLimit"] == LIMITS.pids + 2
    assert host["Memory"] == (LIMITS.memory_mb + LIMITS.workdir_mb + 64 + 16) << 20
    assert host["NanoCpus"] == 1_000_000_000
    assert "size=64m" in host["Tmpfs"]["/work"]
    r = runner.run(box.exec("id -u; cat /proc/self/status | grep CapEff"))
    uid, capeff = r.stdout.split("\n")[:2]
    assert uid == "10001" and capeff.split()[-1] == "0000000000000000", r.stdout


def test_exec_files_and_stdin(box, runner):
    async def go():
        await box.upload("pkg/main.py", "import sys\nprint(sys.stdin.read().upper(), end='')\n")
        r = await box.exec(["python3", "pkg/main.py"], stdin="hello")
        assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "HELLO")
        assert await box.download("pkg/main.py") == b"import sys\nprint(sys.stdin.read().upper(), end='')\n"
        r = await box.exec(script="echo out; echo err >&2; exit 3")
        assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 3, "out\n", "err\n")
        r = await box.exec(["no-such-program"])
        assert r.status == "error" and r.exit_code is None and "no-such-program" in r.detail
        with pytest.raises(FileNotFoundError):
            await box.download("nope.txt")
        with pytest.raises(ValueError, match="'path'"):
            await box.upload("../escape.txt", "x")
        # A symlink in the work dir must not let a download read outside it.
        await box.exec("ln -sf /etc/passwd link")
        with pytest.raises(PermissionError):
            await box.download("link")

    runner.run(go())


def test_closed_sandbox_is_gone(backend, docker_client, runner):
    import docker

    async def go():
        sandbox = await backend.create("python", LIMITS)
        assert await sandbox.alive()
        await sandbox.close()
        await sandbox.close()  # idempotent
        assert not await sandbox.alive()
        with pytest.raises(SandboxError, match="closed"):
            await sandbox.exec("true")
        return sandbox.container.id

    cid = runner.run(go())
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(cid)


def test_cleanup_leaked_removes_only_dead_owners(backend, docker_client, runner):
    """A container whose owner process died is removed; our own live one stays."""
    mine = runner.run(backend.create("python", LIMITS))
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    orphan = docker_client.containers.run(
        backend._image("python"),
        detach=True,
        network_mode="none",
        labels={
            backend.label: "1",
            f"{backend.label}.owner": f"{backend._owner.split(':')[0]}:{dead.pid}:{start}",
        },
    )
    try:
        assert runner.run(backend.cleanup_leaked()) == 1
        assert runner.run(mine.alive())
        ids = [c.id for c in docker_client.containers.list(all=True, filters={"label": backend.label})]
        assert orphan.id not in ids and mine.container.id in ids
    finally:
        runner.run(mine.close())


def test_runtime_is_passed_through(docker_client, runner):
    from palaestra.sandbox.docker import DockerBackend

    b = DockerBackend(label="palaestra-test-runtime", runtime="palaestra-no-such-runtime")
    with pytest.raises(SandboxError, match="palaestra-no-such-runtime"):
        runner.run(b.create("python", LIMITS))
    assert not docker_client.containers.list(all=True, filters={"label": "palaestra-test-runtime"})


def test_unknown_profile_names_the_field(backend, runner):
    with pytest.raises(ValueError, match="'profile'"):
        runner.run(backend.create("cobol", LIMITS))


def test_image_build_is_cached(docker_client):
    from palaestra.sandbox.images import build

    tag = build.ensure_image(docker_client, "python")
    created = docker_client.images.get(tag).attrs["Created"]
    start = time.monotonic()
    assert build.ensure_image(docker_client, "python") == tag
    cached_s = time.monotonic() - start
    assert docker_client.images.get(tag).attrs["Created"] == created  # found, not rebuilt
    print(f"cached image lookup: {cached_s:.2f} s")


def test_runner_channel_is_closed_to_commands(box, runner):
    """The host's socket accepted the container's PID 1 and stopped listening: a command cannot
    talk to it, nor read PID 1's environment or memory (not dumpable)."""
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect('/run/palaestra.sock'); print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "for p in ('/proc/1/environ', '/proc/1/mem'):\n"
        "    try:\n"
        "        open(p, 'rb').read(1); print('READ', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p)\n"
    )
    r = runner.run(box.exec(["python3", "-c", code]))
    assert (
        r.ok and "CONNECTED" not in r.stdout and "READ" not in r.stdout and r.stdout.count("denied") == 2
    ), r


def test_exec_channel_for_remote_engines(docker_client, runner):
    """channel="exec" (docker exec per request, for remote engines and runsc) does the same."""
    from palaestra.sandbox.docker import DockerBackend
    from palaestra.sandbox.docker_channel import ExecChannel

    async def go():
        backend = DockerBackend(label="palaestra-test-docker-exec", channel="exec")
        async with await backend.create("python", LIMITS) as box:
            assert isinstance(box._channel, ExecChannel)
            await box.upload("a.txt", "hello")
            assert await box.download("a.txt") == b"hello"
            r = await box.exec(["python3", "-c", "print(open('a.txt').read())"])
            assert (r.status, r.stdout) == ("ok", "hello\n")
            r = await box.exec(["sleep", "30"], timeout=1)
            assert r.status == "timeout"
            r = await box.exec(
                ["python3", "-c", "x = []\nwhile True: x.append(bytearray(16 << 20))"], timeout=20
            )
            assert r.status == "memory", r
            assert await box.alive()
        await backend.close()

    runner.run(go())
