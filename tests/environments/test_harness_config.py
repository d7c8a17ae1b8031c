"""What a harness is told of the served model (`configure.Budget`: its context window and an output
budget per call, in each harness's own settings), and the line a non-zero exit is logged with. No
harness runs here: these are the generated environments and arguments (the binaries drive sessions
in tests/environments/test_harness_binaries.py). The window is read from a real gateway in front of
`ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from palaestra.environments.harness import configure
from palaestra.environments.harness.env import HarnessEnv, exit_reason
from palaestra.sdk import GatewayClient
from tests.support.servers import ENV_KEY, ScriptedEngine, ThreadServer, gateway_server


def _settings(argv: list[str]) -> dict[str, str]:
    pairs = (argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-c")
    return {k: v for k, v in pairs if not k.startswith("model_provider")}


def test_each_harness_is_told_the_context_window_and_the_output_budget():
    budget = configure.Budget.of(32768)
    assert budget == configure.Budget(32768, 4096)  # an eighth of the window
    env, _ = configure.command(
        "claude-code", "/bin/claude", "http://h/s/1/v1", "tok", "m", "fix", budget=budget
    )
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    _, argv = configure.command("codex", "/bin/codex", "http://h/s/1/v1", "tok", "m", "fix", budget=budget)
    assert _settings(argv) == {
        "model_context_window": "32768",
        "model_max_output_tokens": "4096",
        "model_auto_compact_token_limit": "28672",  # compacts before a full reply no longer fits
    }
    assert argv[-1] == "fix"
    env, _ = configure.command(
        "opencode", "/bin/opencode", "http://h/s/1/v1", "tok", "m", "fix", budget=budget
    )
    model = json.loads(env["OPENCODE_CONFIG_CONTENT"])["provider"]["palaestra"]["models"]["m"]
    assert model["limit"] == {"context": 32768, "output": 4096}  # its max_tokens is the output budget
    # without a budget, nothing of it is set (the harness's own defaults)
    env, _ = configure.command("claude-code", "/bin/claude", "http://h/s/1/v1", "tok", "m", "fix")
    assert not any(k.startswith("CLAUDE_CODE_MAX") for k in env)
    env, _ = configure.command("opencode", "/bin/opencode", "http://h/s/1/v1", "tok", "m", "fix")
    assert "limit" not in json.loads(env["OPENCODE_CONFIG_CONTENT"])["provider"]["palaestra"]["models"]["m"]


def test_the_output_budget_is_sized_to_the_window_or_given():
    assert [configure.default_output_tokens(w) for w in (1024, 8192, 32768, 131072, 1 << 20)] == [
        256, 1024, 4096, 8192, 8192,
    ]  # fmt: skip
    assert configure.Budget.of(32768, 512).max_output_tokens == 512
    for bad in (0, 32768):
        with pytest.raises(ValueError, match="below the model's context window"):
            configure.Budget.of(32768, bad)
    with pytest.raises(ValueError, match="max_output_tokens must be positive"):
        HarnessEnv(max_output_tokens=0)


def test_the_exit_line_says_what_the_harness_stopped_on():
    codex = "ERROR: stream disconnected: incomplete response (reason: max_output_tokens)"
    assert exit_reason(codex) == "max_output_tokens"
    assert exit_reason("Error: Reached max turns (30)") == "max_turns"
    assert exit_reason("This model's maximum context length is 32768 tokens.") == "context_length_exceeded"
    assert exit_reason("Traceback ... KeyError: 'x'") is None


def test_the_context_window_is_the_gateways(tok, tmp_path):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(lambda ids, i: [end], stop_ids={end})
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path, tok, context_length=16384) as gw,
    ):

        async def window() -> int:
            client = GatewayClient(gw.url, ENV_KEY)
            try:
                session = await client.session(env="harness", task_id="t")
                return await HarnessEnv.context_window(session)
            finally:
                await client.close()

        assert asyncio.run(window()) == 16384
