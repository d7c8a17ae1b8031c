"""Tools from MCP servers (``--env mcp-math``): an MCP server started per episode inside the
episode's sandbox, its tools listed to the model as function tools and called through the `mcp`
client.

- ``server.py``: `McpServer`, what to run (no `mcp` import: the harness configures servers with it);
- ``client.py``: `McpTools`, the live connection (tools, call), over `bridge.py`;
- ``bridge.py``: runs inside the sandbox (stdlib only): starts the server, opens it on a unix socket;
- ``env.py``: `McpMathEnv`, math tasks answered with the tools of any MCP server.

docs/environments.md ("Tools from an MCP server") has a copy-paste example.
"""
