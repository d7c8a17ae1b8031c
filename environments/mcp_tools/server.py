"""`McpServer`: what MCP server to run in an episode's sandbox. Imports nothing of the `mcp`
package, so that environments naming servers (the harness's, which only configure them) need not
install it; `client.py` runs them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from palaestra.sandbox.base import WORKDIR

__all__ = ["McpServer"]


@dataclass(frozen=True)
class McpServer:
    """One MCP server to run in each episode's sandbox."""

    name: str
    """Names the server in errors and in a harness's MCP settings."""
    argv: tuple[str, ...]
    """The server's command inside the sandbox (run in the work directory)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Its environment (nothing of the host's; PATH is the sandbox's when not given)."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Files uploaded to the work directory before it starts (path relative to it -> text)."""
    port: int | None = None
    """None: a stdio server. A port: a streamable-HTTP server on 127.0.0.1:port (path `http_path`)."""
    http_path: str = "/mcp"
    start_timeout_s: float = 20.0
    """Seconds to open its socket and answer ``initialize`` and ``tools/list``."""
    call_timeout_s: float = 30.0
    """Seconds one tool call may take."""

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) and a for a in self.argv):
            raise ValueError(f"McpServer.argv must be a non-empty list of strings; got {self.argv!r}")
        object.__setattr__(self, "argv", tuple(self.argv))

    def bridge_config(self, socket_path: str) -> dict[str, Any]:
        """What bridge.py reads on its stdin."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **self.env}
        return {"socket": socket_path, "argv": list(self.argv), "env": env, "cwd": WORKDIR, "port": self.port}
