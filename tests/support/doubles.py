"""TEST DOUBLES for the sandbox interface, for the test suite only (never imported by the product).

`SubprocessSandboxForTests` implements ``palaestra.sandbox.base.Sandbox`` by running commands as
plain subprocesses of this machine in a temporary directory, and `SubprocessBackendForTests` hands
them out. It is NOT isolation: the program can read and write your files, use the network, and
start processes that outlive it. It exists so that the verifiers and environments can be
unit-tested quickly on any machine; real runs and the end-to-end tests use a backend from
``palaestra.sandbox`` (local bubblewrap, docker, remote). An environment takes it by import path,
``backend="tests.support.doubles:SubprocessBackendForTests"``, from the repository root (the
working directory is on the import path of `palaestra.plugins.load_object`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from palaestra.sandbox.base import Backend, ExecResult, Limits, Mount, Sandbox, SandboxError

__all__ = ["SubprocessBackendForTests", "SubprocessSandboxForTests"]


class SubprocessSandboxForTests(Sandbox):
    """TEST DOUBLE — NO ISOLATION. What it enforces: the wall-clock timeout (the whole process
    group is killed), an address-space limit (``RLIMIT_AS`` = ``limits.memory_mb``) and
    ``limits.output_bytes`` kept per stream. A leading ``python``/``python3`` runs this interpreter
    (``sys.executable``) so that tests do not depend on what ``python3`` is on PATH."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.limits = limits or Limits()
        self.root = Path(tempfile.mkdtemp(prefix="palaestra-test-sandbox-")).resolve()
        self.closed = False

    def _path(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root) or path == self.root:
            raise ValueError(f"path escapes the work directory: {rel!r}")
        return path

    async def upload(self, path: str, data: bytes | str) -> None:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    async def download(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    async def alive(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True
        shutil.rmtree(self.root, ignore_errors=True)

    async def exec(
        self,
        cmd: str | list[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if script is not None:
            argv = ["sh", "-c", script]
        elif isinstance(cmd, str):
            argv = ["sh", "-c", cmd]
        elif cmd:
            argv = list(cmd)
        else:
            raise ValueError("exec needs cmd or script")
        if argv[0] in ("python", "python3"):
            argv = [sys.executable, *argv[1:]]
        memory = self.limits.memory_mb * 1024 * 1024

        def limit_memory() -> None:  # runs in the child between fork and exec
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.root,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root)},
                start_new_session=True,  # its own process group, so a timeout kills its children too
                preexec_fn=limit_memory,
            )
        except OSError as exc:
            return ExecResult("error", None, "", "", detail=str(exc))
        out, err = bytearray(), bytearray()
        cap = self.limits.output_bytes

        async def drain(stream: asyncio.StreamReader, buf: bytearray) -> None:
            while chunk := await stream.read(65536):
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]  # keep reading past the cap so the child never blocks

        async def feed() -> None:
            if stdin is not None:
                try:
                    proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass

        readers = asyncio.gather(feed(), drain(proc.stdout, out), drain(proc.stderr, err), proc.wait())
        status = "ok"
        limit = self.limits.timeout_s if timeout is None else timeout
        try:
            await asyncio.wait_for(asyncio.shield(readers), limit)
        except TimeoutError:
            status = "timeout"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:  # a grandchild that left the process group could hold the pipes open
                await asyncio.wait_for(readers, 5.0)
            except TimeoutError:
                readers.cancel()
                await proc.wait()
        return ExecResult(
            status=status,
            exit_code=proc.returncode,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            duration_s=time.monotonic() - start,
            detail=f"killed after {limit} s wall clock" if status == "timeout" else "",
        )


@dataclass
class SubprocessBackendForTests(Backend):
    """TEST DOUBLE — NO ISOLATION: hands out `SubprocessSandboxForTests`."""

    name = "subprocess-test-double"

    async def create(
        self, profile: str = "python", limits: Limits | None = None, *, mounts: tuple[Mount, ...] = ()
    ) -> Sandbox:
        if mounts:
            raise SandboxError("the subprocess test double has no file system of its own to mount into")
        return SubprocessSandboxForTests(limits)

    async def cleanup_leaked(self) -> int:
        return 0
