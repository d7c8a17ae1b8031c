"""A small MCP server of our own (stdio, stdlib only) for the MCP tool tests: it is uploaded into
a sandbox and run there with ``python3 mcp_server.py [MODE]``.

Tools: ``add`` (two integers -> their sum) and ``divide`` (an error result for a zero divisor).
MODE breaks it on purpose: ``crash`` exits 3 before it reads anything, ``hang`` never answers a
tool call, ``malformed`` answers a tool call with a line that is not JSON-RPC. ``http PORT`` serves
the same tools over streamable HTTP on 127.0.0.1:PORT (``POST /mcp``, each answer one JSON body).
"""

import json
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
TOOLS = [
    {
        "name": "add",
        "description": "Add two integers.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "divide",
        "description": "Divide a by b (integer division).",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def text(value, error=False):
    return {"content": [{"type": "text", "text": str(value)}], "isError": error}


def call(name, args):
    if name == "add":
        return text(args["a"] + args["b"])
    if name == "divide":
        if args["b"] == 0:
            return text("division by zero", error=True)
        return text(args["a"] // args["b"])
    return text(f"unknown tool {name}", error=True)


def answer(message):
    """The JSON-RPC answer to `message` (None for a notification or a call left unanswered)."""
    method, rid = message.get("method"), message.get("id")
    if rid is None:
        return None
    if method == "initialize":
        version = message["params"]["protocolVersion"]
        info = {"name": "t", "version": "1"}
        result = {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        result = call(message["params"]["name"], message["params"].get("arguments") or {})
    else:
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def serve_http(port):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = answer(body)
            data = b"" if reply is None else json.dumps(reply).encode()
            self.send_response(202 if reply is None else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # no server-initiated stream
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_DELETE = do_GET

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main():
    if MODE == "http":
        serve_http(int(sys.argv[2]))
        return
    if MODE == "crash":
        sys.stderr.write("mcp_server: crashing on purpose\n")
        sys.exit(3)
    for line in sys.stdin:
        message = json.loads(line)
        method, rid = message.get("method"), message.get("id")
        if rid is None:
            continue  # a notification
        if method == "initialize":
            version = message["params"]["protocolVersion"]
            result = {
                "protocolVersion": version,
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "t", "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": TOOLS}
        elif method == "tools/call":
            if MODE == "hang":
                continue
            if MODE == "malformed":
                sys.stdout.write("this is not json-rpc\n")
                sys.stdout.flush()
                continue
            result = call(message["params"]["name"], message["params"].get("arguments") or {})
        else:
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}})
            continue
        send({"jsonrpc": "2.0", "id": rid, "result": result})


if __name__ == "__main__":
    main()
