"""How the docker backend's host side talks to the runner in a container (images/runner.py).

Two channels, one call: ``await channel.call(mode, spec, payload, wait_s) -> (code, out, err)``,
the runner's exit code, stdout and stderr for that request (``exec``, ``put``, ``get``, ``reap``,
``ping``).

* ``SocketChannel`` (the default with a local engine): the host listens on a unix socket that is
  bind-mounted read-only into the container; the container's PID 1 (the runner) connects once and
  serves requests over it as length-prefixed frames. The host accepts only the container's own
  PID 1 (SO_PEERCRED pid == the container's init pid) and then stops listening, so a command in
  the sandbox that connects too gets nothing. ~1 ms per request.
* ``ExecChannel``: ``docker exec`` of the runner per request (~100 ms: dockerd, containerd and runc
  each take a turn). Used where the socket cannot be shared: a remote engine (DOCKER_HOST over
  TCP/SSH) or a runtime such as gVisor's ``runsc``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any

from palaestra.sandbox.base import WORKDIR, SandboxError
from palaestra.sandbox.images.rootfs import SANDBOX_UID

__all__ = ["RUNNER", "RUNNER_SOCKET", "ExecChannel", "HostSocket", "SocketChannel"]

RUNNER = ["python3", "-I", "-S", "/opt/palaestra/runner.py"]
RUNNER_SOCKET = "/run/palaestra.sock"
"""Where the host's socket appears inside the container."""
FRAME = struct.Struct(">IQ")  # JSON header length, payload length (as runner.py)
Reply = tuple[int | None, bytes, bytes]


class HostSocket:
    """The listening socket a new container's runner connects to, in a private temporary dir."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="palaestra-docker-")
        self.path = os.path.join(self.dir, "runner.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o666)  # the runner connects as uid 10001 (the dir stays private)
        self.listener.listen(4)

    def accept_init(self, init_pid: int, wait_s: float) -> socket.socket:
        """The connection of the process whose host pid is ``init_pid``; others are dropped."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            self.listener.settimeout(left)
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                break
            pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if pid == init_pid:
                conn.settimeout(None)
                return conn
            conn.close()
        raise SandboxError(f"the sandbox's runner did not connect within {wait_s:g} s")

    def close(self) -> None:
        """Stop listening and remove the path (the container keeps its bind mount of the inode)."""
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SocketChannel:
    """Requests carry ids; one reader task files every reply, so a caller that gives up (a
    cancelled or timed-out exec) leaves its reply to be dropped, never read as the next one's."""

    def __init__(self, sandbox_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.sandbox_id = sandbox_id
        self.writer = writer
        self._replies: asyncio.Queue[tuple[int, Reply] | BaseException] = asyncio.Queue()
        self._next_id = 0
        self._reader = asyncio.get_running_loop().create_task(self._read_replies(reader))

    @classmethod
    async def open(cls, sandbox_id: str, conn: socket.socket) -> SocketChannel:
        reader, writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 20)
        return cls(sandbox_id, reader, writer)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                head_len, out_len = FRAME.unpack(await reader.readexactly(FRAME.size))
                head = json.loads(await reader.readexactly(head_len))
                out = await reader.readexactly(out_len)
                self._replies.put_nowait((head["id"], (head["code"], out, head["err"].encode("latin-1"))))
        except (ConnectionError, asyncio.IncompleteReadError, OSError, ValueError) as exc:
            self._replies.put_nowait(SandboxError(f"sandbox {self.sandbox_id}: its runner is gone ({exc!r})"))

    async def call(self, mode: str, spec: dict | None, payload: bytes, wait_s: float) -> Reply:
        rid, self._next_id = self._next_id, self._next_id + 1
        head = json.dumps({"id": rid, "mode": mode, "spec": spec}).encode()
        try:
            self.writer.write(FRAME.pack(len(head), len(payload)) + head + payload)
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise SandboxError(
                f"sandbox {self.sandbox_id}: its runner is gone ({type(exc).__name__})"
            ) from exc
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                item = await asyncio.wait_for(
                    self._replies.get(), deadline - asyncio.get_running_loop().time()
                )
            except TimeoutError:
                return None, b"", b""
            if isinstance(item, BaseException):
                self._replies.put_nowait(item)  # every later call fails the same way
                raise item
            if item[0] == rid:
                return item[1]
            # else: the reply to a call whose caller gave up; dropped

    async def close(self) -> None:
        self._reader.cancel()
        self.writer.close()  # the runner sees EOF and exits, which ends the container


class ExecChannel:
    def __init__(self, sandbox_id: str, client: Any, container_id: str, output_cap: int) -> None:
        self.sandbox_id = sandbox_id
        self.client = client
        self.container_id = container_id
        self.output_cap = output_cap

    async def call(self, mode: str, spec: dict | None, payload: bytes, wait_s: float) -> Reply:
        return await asyncio.to_thread(self._call, mode, spec, payload, wait_s)

    def _call(self, mode: str, spec: dict | None, payload: bytes, wait_s: float) -> Reply:
        """``docker exec`` the runner, send it a JSON line and ``payload``, collect its stdout and
        stderr (docker's multiplexed stream) until it exits."""
        import docker

        api = self.client.api
        try:
            ex = api.exec_create(
                self.container_id,
                RUNNER + [mode],
                stdin=spec is not None,
                user=f"{SANDBOX_UID}:{SANDBOX_UID}",
                workdir=WORKDIR,
            )
            sock = api.exec_start(ex["Id"], socket=True)
        except docker.errors.NotFound as exc:
            raise SandboxError(f"sandbox {self.sandbox_id} is gone") from exc
        except docker.errors.APIError as exc:
            raise SandboxError(f"sandbox {self.sandbox_id}: docker exec failed: {exc.explanation}") from exc
        raw = sock._sock  # the hijacked connection under docker-py's SocketIO wrapper
        raw.settimeout(wait_s)
        chunks: dict[int, list[bytes]] = {1: [], 2: []}
        try:
            if spec is not None:
                raw.sendall(json.dumps(spec).encode() + b"\n" + payload)
                raw.shutdown(socket.SHUT_WR)
            got = 0
            for stream, data in _frames(raw):
                got += len(data)
                if got > self.output_cap and mode != "get":
                    raise SandboxError(
                        f"sandbox {self.sandbox_id}: runner answered more than {self.output_cap} bytes"
                    )
                chunks.setdefault(stream, []).append(data)
        except TimeoutError:
            return None, b"", b""
        finally:
            sock.close()
        info = api.exec_inspect(ex["Id"])
        for _ in range(100):  # the exit is recorded a moment after the stream closes
            if not info.get("Running"):
                break
            time.sleep(0.01)
            info = api.exec_inspect(ex["Id"])
        return info.get("ExitCode"), b"".join(chunks[1]), b"".join(chunks[2])

    async def close(self) -> None:
        return None


def _frames(sock: socket.socket):
    """(stream, bytes) frames of docker's multiplexed exec stream (8-byte header: stream id, 3
    zero bytes, big-endian length) until EOF."""
    header = bytearray()
    while True:
        while len(header) < 8:
            more = sock.recv(8 - len(header))
            if not more:
                return
            header += more
        stream, size = struct.unpack(">BxxxL", header)
        header.clear()
        body = bytearray(size)
        view, got = memoryview(body), 0
        while got < size:
            n = sock.recv_into(view[got:])
            if not n:
                return
            got += n
        yield stream, bytes(body)
