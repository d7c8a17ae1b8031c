"""MCP tool servers in the sandbox (`environments/mcp_tools`): a small MCP server of our own
(tests/support/mcp_server.py: ``add``, and ``divide`` that answers an error result for a zero
divisor) runs inside a local (bubblewrap) sandbox, its tools listed as OpenAI function tools and
called through the `mcp` client; a server that crashes, hangs or answers what is not JSON-RPC
raises `McpError` with the reason. The episode test runs `McpMathEnv` through the real gateway with
a SCRIPTED ENGINE (a labelled TEST DOUBLE from tests/support/servers.py) as the model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from palaestra.environments.episode import ToolResult
from palaestra.environments.mcp_tools.client import McpError, McpTools, run_folder
from palaestra.environments.mcp_tools.env import McpMathEnv
from palaestra.environments.mcp_tools.server import McpServer
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.sandbox.base import Limits
from palaestra.sandbox.local import LocalBackend
from palaestra.sdk.runner import take_tasks
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import rollouts

SOURCE = (Path(__file__).parents[1] / "support" / "mcp_server.py").read_text()


def server(mode: str = "ok", **options) -> McpServer:
    return McpServer("arith", ("python3", "mcp_server.py", mode), files={"mcp_server.py": SOURCE}, **options)


async def with_tools(spec: McpServer, body):
    with run_folder() as folder:
        box = await LocalBackend().create("python", Limits(timeout_s=60), mounts=(McpTools.mount(folder),))
        async with box:
            try:
                async with McpTools.start(box, spec, folder) as mcp:
                    return await body(mcp)
            finally:
                assert not list(Path(folder).glob("*.partial"))


def test_tools_are_listed_as_function_tools_and_called_through_the_mcp_client():
    async def body(mcp: McpTools):
        names = [t["function"]["name"] for t in mcp.tools]
        schema = mcp.tools[0]["function"]["parameters"]
        return (
            names,
            schema,
            await mcp.call("add", {"a": 2, "b": 40}),
            await mcp.call("divide", {"a": 1, "b": 0}),
        )

    names, schema, added, divided = asyncio.run(with_tools(server(), body))
    assert names == ["add", "divide"]
    assert schema["required"] == ["a", "b"] and schema["properties"]["a"] == {"type": "integer"}
    assert added == ToolResult("42")
    assert divided == ToolResult("error: division by zero")  # the model reads it; not an episode failure


def test_a_streamable_http_server_is_reached_through_the_same_socket():
    spec = McpServer(
        "arith-http", ("python3", "mcp_server.py", "http", "8765"), files={"mcp_server.py": SOURCE}, port=8765
    )

    async def body(mcp: McpTools):
        return [t["function"]["name"] for t in mcp.tools], await mcp.call("add", {"a": 1, "b": 2})

    assert asyncio.run(with_tools(spec, body)) == (["add", "divide"], ToolResult("3"))


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("crash", "exited (ok, exit code 3): mcp_server: crashing on purpose"),
        ("hang", "did not answer 'add' within 1.0 s"),
        (
            "malformed",
            "did not answer 'add' within 1.0 s; it also wrote: the server wrote a line that is not",
        ),
    ],
)
def test_a_broken_server_fails_with_the_reason(mode, reason):
    async def body(mcp: McpTools):
        return await mcp.call("add", {"a": 1, "b": 1})

    with pytest.raises(McpError) as caught:
        asyncio.run(with_tools(server(mode, call_timeout_s=1.0, start_timeout_s=10.0), body))
    assert reason in str(caught.value)


def test_a_server_that_never_starts_fails_at_start():
    spec = McpServer("missing", ("/nonexistent/server",), start_timeout_s=10.0)
    with pytest.raises(McpError, match="could not start the MCP server"):
        asyncio.run(with_tools(spec, lambda mcp: asyncio.sleep(0)))


def test_mcp_math_episode_through_the_gateway(tok, tmp_path):
    env = McpMathEnv(server(), difficulty=0, max_turns=3)
    task = take_tasks(env, 1, seed=3)[0]
    call = render_tool_call_text("hermes", "divide", json.dumps({"a": 7, "b": 0}))
    replies = [call, f"So \\boxed{{{task.answer}}}."]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        lambda ids, i: tok.encode(replies[min(i, 1)], add_special_tokens=False) + [end], stop_ids={end}
    )
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path / "spool", tok, api_key="k") as gw,
    ):
        result = rollouts(gw.url, "k", env, [task]).results[0]
        broken = rollouts(gw.url, "k", McpMathEnv(server("crash")), [task]).results[0]
    assert result.status == "completed", result.error
    assert result.reward == 1.0 and result.metrics["tool_calls"] == 1.0
    assert result.metrics["time/mcp_call_s"] > 0
    first = engine.exchanges[0].body["input_ids"]
    assert '"name": "add"' in tok.decode(first) and '"name": "divide"' in tok.decode(
        first
    )  # listed to the model
    assert "<tool_response>\nerror: division by zero\n</tool_response>" in tok.decode(
        engine.exchanges[-1].body["input_ids"]
    )
    assert broken.status == "failed" and "McpError: MCP server 'arith' exited" in broken.error
