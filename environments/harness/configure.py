"""How each harness is pointed at a session: the environment variables and arguments that make it
talk to the session's base URL with the session's token, and to nothing else it needs.

`claude_code` configures Claude Code (`claude -p`): `ANTHROPIC_BASE_URL` is the session URL without
`/v1` (the CLI adds `/v1/messages`), `ANTHROPIC_API_KEY` the session token, and its non-essential
traffic (telemetry, update checks) is switched off. `codex` configures Codex CLI (`codex exec`): a
`model_providers.palaestra` entry with `wire_api = "responses"` and the token in an environment
variable it names (`env_key`), passed as `-c` overrides so no config file is written. `opencode`
configures OpenCode (`opencode run`): an OpenAI-compatible provider (its bundled
`@ai-sdk/openai-compatible`, Chat Completions) in `OPENCODE_CONFIG_CONTENT`, the token read from
an environment variable, every permission allowed, models.dev, updates, sharing and LSP downloads
off. `mini_swe_agent` configures mini-swe-agent (`python -m minisweagent`, its `mini.yaml` agent
in yolo mode): litellm's `openai/<model>` with `api_base` the session URL and the token in
`OPENAI_API_KEY`; litellm's cost map is its bundled copy (no fetch), cost tracking off.
`terminus` configures our Terminus-style agent (terminus/agent.py, run by the sandbox's
`/usr/bin/python3`): `--base-url`, `--model`, the output budget as `--max-tokens`, the token in
`PALAESTRA_SESSION_KEY`.

`mcp_settings` gives a harness MCP servers through its own configuration: Claude Code's
``--mcp-config`` (a JSON object of ``mcpServers``, with ``--strict-mcp-config``: only these; tool
search off, so the tools are listed with their schemas) and
Codex's ``mcp_servers.<name>`` table (``-c`` overrides). The harness starts them itself, as its
children, inside the same sandbox.

`Budget` is what a harness is told of the served model, so that truncation is the exception: its
context window (the gateway's `max_model_len`) and an output budget per call (default
`default_output_tokens`: an eighth of the window, 256 to 8,192 tokens). Claude Code gets them as
`CLAUDE_CODE_MAX_CONTEXT_TOKENS` and `CLAUDE_CODE_MAX_OUTPUT_TOKENS`; Codex as
`model_context_window`, `model_max_output_tokens` and `model_auto_compact_token_limit` (window
less the output budget: it compacts its history before a full reply would no longer fit); OpenCode
as its model's `limit` (`context`, `output`: the `max_tokens` it sends). mini-swe-agent is told
nothing (it sends no max_tokens: the gateway's `default_max_tokens` applies).

`command` is what the harness environment runs in a sandbox: the whole environment (nothing of the
host's) and argv of one headless run on a task, with tools allowed without asking (the sandbox is
the boundary). The turn limit is the tunnel's (`SessionTunnel.max_calls`), the same for every harness.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palaestra.environments.mcp_tools.server import McpServer

__all__ = [
    "TOKEN_VAR",
    "Budget",
    "claude_code",
    "codex",
    "command",
    "default_output_tokens",
    "mcp_settings",
    "mini_swe_agent",
    "opencode",
    "terminus",
]

TOKEN_VAR = "PALAESTRA_SESSION_KEY"
"""The environment variable Codex reads the session token from (its provider's `env_key`)."""


def default_output_tokens(context_window: int) -> int:
    """A call's output budget for a model with this context window: an eighth of it, 256 to 8,192
    (32k -> 4,096; the harnesses' own defaults, 32k and more, exceed small models' windows)."""
    return max(256, min(8192, context_window // 8))


@dataclass(frozen=True)
class Budget:
    """The served model's context window and the output tokens a harness may ask per call."""

    context_window: int
    max_output_tokens: int

    @classmethod
    def of(cls, context_window: int, max_output_tokens: int | None = None) -> Budget:
        """`max_output_tokens` None: `default_output_tokens(context_window)`; it must leave room
        for a prompt (ValueError naming both otherwise)."""
        out = default_output_tokens(context_window) if max_output_tokens is None else int(max_output_tokens)
        if not 0 < out < context_window:
            raise ValueError(
                f"max_output_tokens {out} must be positive and below the model's context window "
                f"({context_window} tokens)"
            )
        return cls(int(context_window), out)


def claude_code(base_url: str, token: str, budget: Budget | None = None) -> dict[str, str]:
    """The environment for `claude` to use the session at `base_url` (`.../s/<id>/v1`), told the
    model's `budget` when given."""
    env = {
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": token,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # the harness runs in a sandbox: it may run tools without asking
    }
    if budget is not None:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(budget.context_window)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(budget.max_output_tokens)
    return env


def codex(
    base_url: str, token: str, model: str, budget: Budget | None = None
) -> tuple[dict[str, str], list[str]]:
    """(environment, `codex exec` arguments before the prompt) to use the session at `base_url`,
    told the model's `budget` when given."""
    provider = {"name": "palaestra", "base_url": base_url, "wire_api": "responses", "env_key": TOKEN_VAR}
    args = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    for key, value in provider.items():
        args += ["-c", f"model_providers.palaestra.{key}={json.dumps(value)}"]
    args += ["-c", "model_provider=palaestra", "-m", model]
    if budget is not None:
        settings = {
            "model_context_window": budget.context_window,
            "model_max_output_tokens": budget.max_output_tokens,
            "model_auto_compact_token_limit": budget.context_window - budget.max_output_tokens,
        }
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
    return {TOKEN_VAR: token}, args


def opencode(
    base_url: str, token: str, model: str, budget: Budget | None = None
) -> tuple[dict[str, str], list[str]]:
    """(environment, `opencode` arguments before the prompt) to use the session at `base_url`,
    told the model's `budget` when given (its `max_tokens` is the output budget; without one, 32,000)."""
    entry: dict = {"name": model}
    if budget is not None:
        entry["limit"] = {"context": budget.context_window, "output": budget.max_output_tokens}
    config = {
        "provider": {
            "palaestra": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "palaestra",
                "options": {"baseURL": base_url, "apiKey": f"{{env:{TOKEN_VAR}}}"},
                "models": {model: entry},
            }
        },
        "model": f"palaestra/{model}",
        "permission": {"*": "allow"},  # the sandbox is the boundary
        "autoupdate": False,
        "share": "disabled",
    }
    env = {
        TOKEN_VAR: token,
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # no ~/.claude prompts or skills read
        "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
    }
    return env, ["run", "--model", f"palaestra/{model}"]


MINI_FINISH = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""What mini-swe-agent's bash command prints to end its run (its `mini.yaml`)."""


def mini_swe_agent(base_url: str, token: str, model: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments after `python -m minisweagent`, before the task) to use the session
    at `base_url`. Its own step and cost limits are off: the tunnel's turn budget is the limit."""
    env = {
        "OPENAI_API_KEY": token,
        "MSWEA_CONFIGURED": "true",  # no first-run setup prompt
        "MSWEA_COST_TRACKING": "ignore_errors",  # a session's model has no price in litellm's map
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled map, not a download at import
    }
    args = ["-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={base_url}"]
    args += ["-c", "agent.step_limit=0", "-c", "agent.cost_limit=0", "-m", f"openai/{model}"]
    return env, [*args, "--yolo", "--exit-immediately", "-o", f"{HOME}/mini.traj.json", "-t"]


PYTHON = "/usr/bin/python3"
"""The sandbox's Python, which runs our own harness (every sandbox has it: install.SANDBOX_PYTHON)."""


def terminus(
    base_url: str, token: str, model: str, budget: Budget | None = None
) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments after the agent's path, before the task) to use the session at
    `base_url`, asking the `budget`'s output tokens per call when given (else it sends none)."""
    args = ["--base-url", base_url, "--model", model]
    if budget is not None:
        args += ["--max-tokens", str(budget.max_output_tokens)]
    return {TOKEN_VAR: token}, args


SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "USER": "sandbox"}
HOME = "/work/home"
"""The harness's home inside the sandbox, beside the repository (/work/repo): its state (~/.claude,
$CODEX_HOME) stays out of the diff that is graded. Not under /tmp: Codex makes no helper
binaries under a temporary directory."""
HOME_DIRS = ("HOME", "CODEX_HOME")
"""The variables naming folders that must exist before the harness starts."""
HARNESS_NAMES = ("claude-code", "codex", "opencode", "mini-swe-agent", "terminus")
"""The harnesses `command` runs (each of install.HARNESSES)."""


def mcp_settings(name: str, servers: Sequence[McpServer]) -> list[str]:
    """Arguments giving harness `name` the stdio MCP `servers` (their `argv` and `env`; a server's
    command runs in the sandbox, so its paths are the sandbox's)."""
    if not servers:
        return []
    for server in servers:
        if server.port is not None:
            raise ValueError(f"MCP server {server.name!r}: a harness is given stdio servers only")
    if name == "claude-code":
        config = {
            s.name: {"type": "stdio", "command": s.argv[0], "args": list(s.argv[1:]), "env": dict(s.env)}
            for s in servers
        }
        return ["--mcp-config", json.dumps({"mcpServers": config}), "--strict-mcp-config"]
    if name == "codex":
        args = []
        for s in servers:
            table = f"mcp_servers.{s.name}"
            args += [
                "-c",
                f"{table}.command={json.dumps(s.argv[0])}",
                "-c",
                f"{table}.args={json.dumps(list(s.argv[1:]))}",
            ]
            for key, value in s.env.items():
                args += ["-c", f"{table}.env.{key}={json.dumps(value)}"]
        return args
    raise ValueError(f"no MCP settings for harness {name!r}: one of claude-code, codex")


def command(
    name: str,
    binary: str,
    base_url: str,
    token: str,
    model: str,
    prompt: str,
    mcp_servers: Sequence[McpServer] = (),
    budget: Budget | None = None,
) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of one headless run of harness `name` (its binary at `binary`) on
    `prompt`, talking to the session at `base_url` with `token`, given `mcp_servers`, told the
    model's `budget`."""
    env = {**SANDBOX_ENV, "HOME": HOME}
    mcp = mcp_settings(name, mcp_servers)
    if name == "claude-code":
        env |= claude_code(base_url, token, budget)
        if mcp:
            # MCP tools listed with their schemas: Claude Code's tool search would defer them behind
            # its ToolSearch tool, whose results (tool_reference blocks) the gateway does not take.
            env["ENABLE_TOOL_SEARCH"] = "false"
        # No --max-turns: the tunnel's budget of model calls is the one turn limit of every
        # harness (Claude Code's own would end it first, exiting 1 "Reached max turns").
        return env, [binary, "-p", prompt, "--model", model, "--dangerously-skip-permissions", *mcp]
    if name == "codex":
        extra, args = codex(base_url, token, model, budget)
        return env | extra | {"CODEX_HOME": f"{HOME}/.codex"}, [binary, *args, *mcp, prompt]
    if mcp:
        raise ValueError(f"no MCP settings for harness {name!r}: one of claude-code, codex")
    if name == "opencode":
        extra, args = opencode(base_url, token, model, budget)
        return env | extra, [binary, *args, prompt]
    if name == "mini-swe-agent":
        extra, args = mini_swe_agent(base_url, token, model)
        return env | extra, [binary, "-m", "minisweagent", *args, prompt]
    if name == "terminus":
        extra, args = terminus(base_url, token, model, budget)
        return env | extra, [PYTHON, "-I", "-S", binary, *args, prompt]
    raise ValueError(f"no headless command for harness {name!r}: one of {', '.join(HARNESS_NAMES)}")
