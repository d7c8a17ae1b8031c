"""A harness episode given an MCP server through its own configuration: the settings each harness
gets (Claude Code's ``--mcp-config``, Codex's ``mcp_servers`` table), and the real Claude Code
binary in a local (bubblewrap) sandbox starting our small MCP server (tests/support/mcp_server.py)
as its child and calling its tool. The model is `ScriptedEngine`, a labelled TEST DOUBLE
(tests/support/servers.py) that calls the MCP tool on cue; gateway, tunnel, sandbox and binary are
real."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from palaestra.environments.harness import configure
from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.mcp_tools.server import McpServer
from palaestra.gateway.parsers import render_tool_call_text
from tests.environments.test_harness_env import _installed, local_backend, stack  # noqa: F401
from tests.support.servers import ENV_KEY
from tests.support.sessions import AUTH, rollouts

SOURCE = (Path(__file__).parents[1] / "support" / "mcp_server.py").read_text()
SERVER = McpServer(
    "arith",
    ("python3", "/work/mcp/mcp_server.py"),
    env={"MODE_NOTE": "x"},
    files={"mcp/mcp_server.py": SOURCE},
)


def test_each_harness_gets_the_servers_in_its_own_settings():
    env, argv = configure.command(
        "claude-code", "/bin/claude", "http://h/s/1/v1", "tok", "m", "fix it", [SERVER]
    )
    at = argv.index("--mcp-config")
    assert json.loads(argv[at + 1]) == {
        "mcpServers": {
            "arith": {
                "type": "stdio",
                "command": "python3",
                "args": ["/work/mcp/mcp_server.py"],
                "env": {"MODE_NOTE": "x"},
            }
        }
    }
    assert "--strict-mcp-config" in argv and env["ENABLE_TOOL_SEARCH"] == "false"
    _, argv = configure.command("codex", "/bin/codex", "http://h/s/1/v1", "tok", "m", "fix it", [SERVER])
    assert argv[-1] == "fix it"
    settings = [
        argv[i + 1] for i, a in enumerate(argv) if a == "-c" and argv[i + 1].startswith("mcp_servers.")
    ]
    assert settings == [
        'mcp_servers.arith.command="python3"',
        'mcp_servers.arith.args=["/work/mcp/mcp_server.py"]',
        'mcp_servers.arith.env.MODE_NOTE="x"',
    ]
    with pytest.raises(ValueError, match="stdio servers only"):
        configure.mcp_settings("codex", [McpServer("web", ("srv",), port=8000)])
    assert configure.mcp_settings("claude-code", []) == []


class McpScript:
    """TEST DOUBLE: the first call whose prompt lists the MCP tool gets a call of it (4000 + 2); once
    its result (4002) is in a prompt, a final text; other calls (side requests) a short text."""

    TOOL = "mcp__arith__add"

    def __init__(self, tok):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[str] = []

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if "4002" in prompt:
            kind, text = "final", "Done."
        elif f'"name": "{self.TOOL}"' in prompt and "tool" not in self.calls:
            kind, text = "tool", render_tool_call_text("hermes", self.TOOL, json.dumps({"a": 4000, "b": 2}))
        else:
            kind, text = "other", "ok"
        self.calls.append(kind)
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


@pytest.mark.slow
def test_claude_code_calls_an_mcp_server_in_its_sandbox(tok, tmp_path, local_backend, swe_data):  # noqa: F811
    _installed("claude-code")
    env = HarnessEnv(
        harness="claude-code",
        data=str(swe_data),
        backend=local_backend,
        max_turns=6,
        time_limit_s=300,
        mcp_servers=[
            {
                "name": SERVER.name,
                "argv": list(SERVER.argv),
                "env": dict(SERVER.env),
                "files": dict(SERVER.files),
            }
        ],
    )
    instance = env.tasks(0)[0]
    script = McpScript(tok)
    # Every tool listed with its schema (tool search off) outgrows the tiny preset's 32k context.
    with stack(tok, tmp_path, script, context_length=131072) as (gw, _):
        result = rollouts(gw.url, ENV_KEY, env, [instance]).results[0]
        traj = httpx.get(f"{gw.url}/sessions/{result.session_id}", headers=AUTH).json()
    assert result.status == "completed", result.error
    assert traj["refused"] == {} and traj["failed_calls"] == [], (traj["refused"], traj["failed_calls"])
    assert script.calls.index("tool") < script.calls.index("final"), script.calls  # listed, called, answered
    assert result.metrics["failure/harness_exit"] == 0 and result.metrics["failure/harness_timeout"] == 0


def test_opencode_and_mini_swe_agent_take_no_mcp_servers_and_no_token_in_argv():
    """The harnesses without MCP settings here refuse servers by name; every harness's token is in
    its environment, never its argv (forward.py gets it on stdin)."""
    for name in ("opencode", "mini-swe-agent"):
        with pytest.raises(ValueError, match=f"no MCP settings for harness '{name}'"):
            configure.command(name, "/bin/x", "http://h/s/1/v1", "tok", "m", "fix it", [SERVER])
    for name in configure.HARNESS_NAMES:
        env, argv = configure.command(name, "/bin/x", "http://h/s/1/v1", "secret-token", "m", "fix it")
        assert not any("secret-token" in a for a in argv) and "secret-token" in env.values(), (name, argv)
        assert any("http://h/s/1" in a for a in [*argv, *env.values()]) and "fix it" in argv, argv
