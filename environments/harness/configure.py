"""How each harness is pointed at a session: the environment variables and arguments that make it
talk to the session's base URL with the session's token, and to nothing else it needs.

`claude_code` configures Claude Code (`claude -p`): `ANTHROPIC_BASE_URL` is the session URL without
`/v1` (the CLI adds `/v1/messages`), `ANTHROPIC_API_KEY` the session token, and its non-essential
traffic (telemetry, update checks) is switched off. `codex` configures Codex CLI (`codex exec`): a
`model_providers.palaestra` entry with `wire_api = "responses"` and the token in an environment
variable it names (`env_key`), passed as `-c` overrides so no config file is written.
"""

from __future__ import annotations

import json

__all__ = ["TOKEN_VAR", "claude_code", "codex"]

TOKEN_VAR = "PALAESTRA_SESSION_KEY"
"""The environment variable Codex reads the session token from (its provider's `env_key`)."""


def claude_code(base_url: str, token: str) -> dict[str, str]:
    """The environment for `claude` to use the session at `base_url` (`.../s/<id>/v1`)."""
    return {
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": token,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # the harness runs in a sandbox: it may run tools without asking
    }


def codex(base_url: str, token: str, model: str) -> tuple[dict[str, str], list[str]]:
    """(environment, `codex exec` arguments before the prompt) to use the session at `base_url`."""
    provider = {"name": "palaestra", "base_url": base_url, "wire_api": "responses", "env_key": TOKEN_VAR}
    args = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    for key, value in provider.items():
        args += ["-c", f"model_providers.palaestra.{key}={json.dumps(value)}"]
    args += ["-c", "model_provider=palaestra", "-m", model]
    return {TOKEN_VAR: token}, args
