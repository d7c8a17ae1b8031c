"""TEST DOUBLES for the verifiers. Not for training runs.

`LocalSubprocessSandboxForTests` satisfies the `palaestra.verifiers.code.Sandbox` protocol by
running the command as a plain subprocess of this machine, in a temporary directory. It is NOT
isolation: the program can read and write your files, use the network, and start processes that
outlive it. It exists so that `verify_code` can be unit-tested on any machine; real runs use a
backend from ``palaestra.sandbox`` (docker, bubblewrap).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from palaestra.verifiers.code import RunResult

__all__ = ["LocalSubprocessSandboxForTests"]


class LocalSubprocessSandboxForTests:
    """TEST DOUBLE — NO ISOLATION. Runs ``command`` in a fresh temporary directory.

    What it does enforce: the wall-clock ``timeout_s`` (the whole process group is killed), an
    address-space limit of ``memory_mb`` (``RLIMIT_AS``; 0 = none), and at most
    ``max_output_bytes`` kept per stream. A leading ``python``/``python3`` in ``command`` runs this
    interpreter (``sys.executable``) so that tests do not depend on what ``python3`` is on PATH."""

    def __init__(self, *, max_output_bytes: int = 1 << 20) -> None:
        self.max_output_bytes = max_output_bytes

    async def run(
        self, files: dict[str, str], command: list[str], timeout_s: float, memory_mb: int
    ) -> RunResult:
        if command and command[0] in ("python", "python3"):
            command = [sys.executable, *command[1:]]
        with tempfile.TemporaryDirectory(prefix="palaestra-test-sandbox-") as workdir:
            root = Path(workdir).resolve()
            for rel, text in files.items():
                path = (root / rel).resolve()
                if not path.is_relative_to(root) or path == root:
                    raise ValueError(f"file path escapes the working directory: {rel!r}")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            return await self._run(command, workdir, timeout_s, memory_mb)

    async def _run(self, command: list[str], workdir: str, timeout_s: float, memory_mb: int) -> RunResult:
        def limit_memory() -> None:  # runs in the child between fork and exec
            if memory_mb > 0:
                import resource

                limit = memory_mb * 1024 * 1024
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *command,
            cwd=workdir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": workdir,
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            start_new_session=True,  # its own process group, so a timeout kills its children too
            preexec_fn=limit_memory,
        )
        out, err = bytearray(), bytearray()

        async def drain(stream: asyncio.StreamReader, buf: bytearray) -> None:
            while chunk := await stream.read(65536):
                room = self.max_output_bytes - len(buf)
                if room > 0:
                    buf += chunk[:room]  # keep reading past the cap so the child never blocks

        readers = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err), proc.wait())
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(readers), timeout_s)
        except TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # A grandchild that left the process group could hold the pipes open; do not wait on it.
            try:
                await asyncio.wait_for(readers, 5.0)
            except TimeoutError:
                readers.cancel()
                await proc.wait()
        return RunResult(
            exit_code=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )
