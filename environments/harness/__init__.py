"""Real coding-agent harnesses (Claude Code, Codex CLI, OpenCode, mini-swe-agent) run unchanged
against a session's URL, and so does ours, `terminus/` (a Terminus-style terminal agent).

`install.py` installs a harness binary at its pinned version from npm into a cache (offline
afterwards) and finds it; `configure.py` gives the environment variables and arguments that point
each harness at a session's base URL and token; `tunnel.py` is the unix socket a harness sandbox
reaches its own session through, and nothing else. docs/harnesses.md says how to run each one.
"""
