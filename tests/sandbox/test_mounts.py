"""`Mount`: host paths shown in one sandbox (a harness install read-only, a tunnel socket's
directory). Its rules, and the local (bubblewrap) backend's mounts: read-only unless writable; a
source that the sandbox's user could not reach is refused before anything starts by a backend held
to `unprivileged` (in `auto` that sandbox starts in root-userns and its `enforced` says why)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from palaestra.sandbox.base import Mount, SandboxError
from tests.support.sandbox import SANDBOX_BACKENDS


@pytest.fixture
def open_dir():
    """A directory every user can enter (pytest's tmp_path is inside a closed one)."""
    path = tempfile.mkdtemp(prefix="palaestra-mount-test-")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "target, word",
    [("work/x", "absolute"), ("/opt/../work", "normalised"), ("/work/x", "/work"), ("/usr/lib/x", "/usr")],
)
def test_a_mount_target_names_what_is_wrong(target, word):
    with pytest.raises(ValueError, match=word.replace("/", "/")):
        Mount("/opt", target)


def test_local_sandbox_sees_a_mount_read_only(open_dir):
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    shown = open_dir / "shown"
    shown.mkdir(mode=0o755)
    (shown / "hello.txt").write_text("hi")

    async def run(backend):
        box = await backend.create("python", mounts=(Mount(str(shown), "/opt/shown"),))
        try:
            read = await box.exec("cat /opt/shown/hello.txt")
            write = await box.exec("echo x > /opt/shown/new.txt")
        finally:
            await box.close()
        return read, write

    with SANDBOX_BACKENDS["local"]() as make:
        read, write = asyncio.run(run(make()))
    assert read.ok and read.stdout == "hi", read
    assert write.exit_code != 0 and "Read-only" in write.stderr, write
    assert not (shown / "new.txt").exists()


def test_local_backend_in_unprivileged_mode_refuses_a_source_its_user_cannot_reach(open_dir):
    """Without readable stand-ins (`share=False`; by default a read-only mount gets one,
    tests/environments/test_swe_repo_env.py) a backend held to `unprivileged` says what to change,
    and in mode `auto` such a sandbox starts in root-userns instead; a writable mount never gets a
    stand-in (the host must see what the sandbox writes)."""
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    if os.geteuid() != 0:
        pytest.skip("only root runs sandboxes as another user (uid 65534); here they run as this user")
    closed = open_dir / "closed"
    (closed / "inner").mkdir(parents=True)
    os.chmod(closed, 0o700)

    async def run(backend):
        return await backend.create("python", mounts=(Mount(str(closed / "inner"), "/opt/inner"),))

    from palaestra.sandbox.local import LocalBackend

    with pytest.raises(SandboxError, match=f"under {closed} .mode 700., which uid 65534 cannot enter"):
        asyncio.run(run(LocalBackend(mode="unprivileged", share=False)))
    writable = Mount(str(closed / "inner"), "/opt/inner", writable=True)
    with pytest.raises(SandboxError, match=f"under {closed} .mode 700., which uid 65534 cannot enter"):
        asyncio.run(LocalBackend(mode="unprivileged").create("python", mounts=(writable,)))
