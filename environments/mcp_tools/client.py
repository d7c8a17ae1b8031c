"""MCP tool servers run per episode inside the episode's sandbox, their tools given to the model.

    SERVER = McpServer("calc", argv=("python3", "server.py"), files={"server.py": SOURCE})

    with run_folder() as folder:
        box = await backend.create("python", limits, mounts=(McpTools.mount(folder),))
        async with box, McpTools.start(box, SERVER, folder) as mcp:
            loop = ToolLoop(mcp.tools, max_turns=4, max_tokens=256)   # as OpenAI function tools
            episode = await loop.run(session, messages, mcp.call, model=..., log=log)

`McpTools.start` uploads the server's `files`, then starts `bridge.py` in the sandbox as one
exec: the bridge runs the server and opens it to the host through a unix socket in a directory
mounted into the sandbox (the sandbox has no network). The host speaks MCP over that socket with
the `mcp` package's `ClientSession`: a stdio server's newline-delimited JSON-RPC relayed byte for
byte (`socket_transport`), or, for a server with a `port`, streamable HTTP over the socket.

The bridge is one long exec: on a backend that runs one exec of a sandbox at a time (the local
one serialises `exec` and `upload` per sandbox), nothing else runs in that sandbox while the server
does, so an environment that also runs commands of its own gives them another sandbox.

The tools are listed once (``tools/list``) and become OpenAI function tools (name, description,
``inputSchema`` as ``parameters``). `McpTools.call` is a `ToolFn`: the result's text content is the
tool message; a result the server flags ``isError`` is the model's to read ("error: ..."), not a
failure of the episode.

What fails the episode, with `McpError` naming why (the runner records the episode as failed with
that reason and goes on; the sandbox's close kills the server): a server that exits or never
opens its socket within `McpServer.start_timeout_s`, one that does not answer ``initialize`` or
``tools/list`` in that time, a call unanswered within `McpServer.call_timeout_s`, and an answer
the client cannot read (malformed JSON-RPC, a result that is not a tool result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
from mcp import types
from mcp.client.session import ClientSession
from mcp.shared.message import SessionMessage

from palaestra.environments.episode import ToolResult
from palaestra.environments.mcp_tools.server import McpServer
from palaestra.sandbox.base import ExecResult, Mount, Sandbox

__all__ = ["BRIDGE", "RUN_DIR", "McpError", "McpServer", "McpTools", "run_folder", "socket_transport"]

BRIDGE = Path(__file__).with_name("bridge.py")
RUN_DIR = "/run/palaestra-mcp"
"""Where the episode's run directory (bridge.py and the socket) is mounted in the sandbox."""


class McpError(RuntimeError):
    """An MCP server failed the episode: it did not start, hung, or answered what cannot be read."""


@contextlib.asynccontextmanager
async def socket_transport(path: str) -> AsyncIterator[tuple[Any, Any]]:
    """MCP's stdio framing (one JSON-RPC message a line) over the unix socket at `path`: the
    (read, write) stream pair a `ClientSession` takes. A line that is not JSON-RPC is handed to
    the session as an exception (its message handler records it)."""
    stream = await anyio.connect_unix(path)
    read_in, read_out = anyio.create_memory_object_stream[SessionMessage | Exception](16)
    write_in, write_out = anyio.create_memory_object_stream[SessionMessage](16)

    async def reader() -> None:
        buffer = b""
        async with read_in:
            with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                while True:
                    buffer += await stream.receive(1 << 16)
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            await read_in.send(_parse_line(line))

    async def writer() -> None:
        async with write_out:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for message in write_out:
                    text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stream.send(text.encode() + b"\n")

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(writer)
        try:
            yield read_out, write_in
        finally:
            tg.cancel_scope.cancel()
            await stream.aclose()


def _parse_line(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return McpError(f"the server wrote a line that is not JSON-RPC: {line[:200]!r} ({exc})")


def openai_tool(tool: types.Tool) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool."""
    parameters = dict(tool.input_schema or {}) or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description or "", "parameters": parameters},
    }


def result_text(result: types.CallToolResult) -> str:
    """The text a tool result shows the model: its text parts, the others named by kind."""
    parts = [c.text if isinstance(c, types.TextContent) else f"[{c.type} content]" for c in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    text = "\n".join(parts)
    return f"error: {text}" if result.is_error else text


class McpTools:
    """A live connection to one MCP server in an episode's sandbox (module docstring)."""

    def __init__(self, server: McpServer, session: ClientSession, tools: list[dict[str, Any]]):
        self.server, self.session, self.tools = server, session, tools
        self.calls = 0
        self.seconds = 0.0
        """Seconds spent in tool calls (the round trips through the socket and the server)."""
        self._stream_errors: list[Exception] = []

    @staticmethod
    def mount(run_dir: str) -> Mount:
        """The run directory's mount: writable (the bridge binds the socket there) and live."""
        return Mount(run_dir, RUN_DIR, writable=True, live=True)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, box: Sandbox, server: McpServer, run_dir: str) -> AsyncIterator[McpTools]:
        """`server` running in `box`, its tools listed; `run_dir` is the host folder (`run_folder`)
        that `box` was created with mounted at `RUN_DIR` (`mount`)."""
        shutil.copy(BRIDGE, Path(run_dir) / "bridge.py")
        for path, text in server.files.items():
            await box.upload(path, text)
        socket_path = str(Path(run_dir) / "mcp.sock")
        config = server.bridge_config(f"{RUN_DIR}/mcp.sock")
        bridge = asyncio.ensure_future(
            box.exec(["python3", "-I", "-S", f"{RUN_DIR}/bridge.py"], stdin=json.dumps(config), timeout=3600)
        )
        errors: list[Exception] = []
        started, interrupted = False, None
        try:
            await _wait_for_socket(server, socket_path, bridge)
            async with _transport(server, socket_path) as (read, write):

                async def on_message(message: Any) -> None:
                    if isinstance(message, Exception):
                        errors.append(message)

                async with ClientSession(read, write, message_handler=on_message) as session:
                    try:
                        with anyio.fail_after(server.start_timeout_s):
                            await session.initialize()
                            listed = await session.list_tools()
                    except TimeoutError:
                        raise McpError(
                            _why(server, "did not answer initialize and tools/list", errors)
                        ) from None
                    except Exception as exc:
                        raise McpError(await _ended(server, bridge, f"failed to start MCP ({exc})")) from exc
                    tools = cls(server, session, [openai_tool(t) for t in listed.tools])
                    tools._stream_errors = errors
                    started = True
                    try:
                        yield tools
                    except BaseException as exc:
                        interrupted = exc
                        raise
        except OSError as exc:  # the socket went away before the client connected
            raise McpError(await _ended(server, bridge, f"could not be reached ({exc})")) from exc
        finally:
            bridge.cancel()  # the exec's own cancel kills the bridge and the server in it
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await bridge
        # Reached only when the connection's end cancelled what ran in it (the client's task group
        # absorbs that cancellation): never a silent success.
        if not started:
            raise McpError(await _ended(server, bridge, "closed the connection while starting"))
        if interrupted is not None:
            raise McpError(
                _why(server, f"closed the connection during the episode ({interrupted!r})", errors)
            )

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """A `ToolFn`: runs tool `name` on the server; raises `McpError` when the server hangs or
        answers what cannot be read."""
        start = time.perf_counter()
        try:
            with anyio.fail_after(self.server.call_timeout_s):
                result = await self.session.call_tool(name, arguments)
        except TimeoutError:
            raise McpError(
                _why(
                    self.server,
                    f"did not answer {name!r} within {self.server.call_timeout_s} s",
                    self._stream_errors,
                )
            ) from None
        except McpError:
            raise
        except Exception as exc:
            raise McpError(
                _why(self.server, f"answered {name!r} with what cannot be read ({exc})", [])
            ) from exc
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start
        return ToolResult(result_text(result))


def _why(server: McpServer, what: str, errors: list[Exception]) -> str:
    tail = f"; it also wrote: {errors[-1]}" if errors else ""
    return f"MCP server {server.name!r} {what}{tail}"


async def _ended(server: McpServer, bridge: asyncio.Future[ExecResult], what: str) -> str:
    """Why the server is gone: how the bridge's exec ended when it has (waited for briefly), else `what`."""
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(bridge), 2.0)
    if bridge.done() and not bridge.cancelled():
        return _exit_reason(server, bridge)
    return _why(server, what, [])


def _exit_reason(server: McpServer, bridge: asyncio.Future[ExecResult]) -> str:
    if bridge.exception() is not None:
        return f"MCP server {server.name!r} could not be started: {bridge.exception()}"
    result = bridge.result()
    output = (result.stderr or result.stdout)[-500:].strip()
    return f"MCP server {server.name!r} exited ({result.status}, exit code {result.exit_code}): {output}"


async def _wait_for_socket(server: McpServer, path: str, bridge: asyncio.Future[ExecResult]) -> None:
    deadline = time.monotonic() + server.start_timeout_s
    while not os.path.exists(path):
        if bridge.done():
            raise McpError(_exit_reason(server, bridge))
        if time.monotonic() > deadline:
            raise McpError(
                f"MCP server {server.name!r} did not open its socket within {server.start_timeout_s} s"
            )
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _transport(server: McpServer, socket_path: str) -> AsyncIterator[tuple[Any, Any]]:
    if server.port is None:
        async with socket_transport(socket_path) as streams:
            yield streams
        return
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    client = httpx2.AsyncClient(
        transport=httpx2.AsyncHTTPTransport(uds=socket_path), timeout=server.call_timeout_s
    )
    async with (
        client,
        streamable_http_client(f"http://sandbox{server.http_path}", http_client=client) as streams,
    ):
        yield streams[0], streams[1]


@contextlib.contextmanager
def run_folder() -> Iterator[str]:
    """A host folder for one episode's bridge and socket, open to the sandbox's user."""
    with tempfile.TemporaryDirectory(prefix="palaestra-mcp-") as folder:
        os.chmod(folder, 0o777)  # the sandbox's user (uid 65534 under root) binds the socket here
        yield folder
