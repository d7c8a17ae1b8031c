"""Runs an MCP server inside its sandbox and opens it to the host through one unix socket.

Not imported by the host: `client.py` copies this file into the episode's run directory, which is
mounted (writable, live) at /run/palaestra-mcp in the sandbox, and starts it as one exec,
``python3 -I -S /run/palaestra-mcp/bridge.py`` (stdlib only), with a JSON object on stdin:

    {"socket": "/run/palaestra-mcp/mcp.sock", "argv": ["python3", "server.py"], "env": {...},
     "cwd": "/work", "port": null}

It starts the server (``argv`` with ``env``, its own process group), binds ``socket`` and relays:
with ``port`` null (a stdio server) the first connection's bytes go to the server's stdin and its
stdout comes back, newline-delimited JSON-RPC as MCP's stdio transport speaks it; with a ``port``
(a streamable-HTTP server listening on 127.0.0.1:port of the sandbox's own network namespace) each
connection is relayed to that port. It exits with the server's status when the server exits, and
the sandbox's close kills whatever is left.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time


def pump(read, write, done):
    try:
        while True:
            data = read()
            if not data:
                break
            write(data)
    except OSError:
        pass
    finally:
        done()


def shut(sock, how):
    try:
        sock.shutdown(how)
    except OSError:
        pass


def relay_stdio(listener, proc):
    conn, _ = listener.accept()
    out = proc.stdout

    def close_stdin():
        try:
            proc.stdin.close()
        except OSError:
            pass

    threading.Thread(
        target=pump, args=(lambda: conn.recv(1 << 16), proc.stdin.write, close_stdin), daemon=True
    ).start()
    threading.Thread(
        target=pump,
        args=(lambda: out.read(1 << 16), conn.sendall, lambda: shut(conn, socket.SHUT_WR)),
        daemon=True,
    ).start()


CONNECT_S = 10.0
"""How long a connection waits for the server to listen on its port (it may still be starting)."""


def connect(port):
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def relay_port(listener, port):
    while True:
        conn, _ = listener.accept()
        upstream = connect(port)
        if upstream is None:
            sys.stderr.write(f"bridge: nothing listens on port {port} ({CONNECT_S} s after the call)\n")
            conn.close()
            continue
        upstream.settimeout(None)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(
                target=pump,
                args=(lambda s=src: s.recv(1 << 16), dst.sendall, lambda d=dst: shut(d, socket.SHUT_WR)),
                daemon=True,
            ).start()


def main():
    config = json.loads(sys.stdin.read())
    port = config.get("port")
    stdio = subprocess.PIPE if port is None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            config["argv"],
            env=config.get("env") or None,
            cwd=config.get("cwd") or None,
            stdin=stdio,
            stdout=subprocess.PIPE if port is None else sys.stderr,
            bufsize=0,
            start_new_session=True,
        )
    except OSError as exc:
        sys.stderr.write(f"bridge: could not start the MCP server {config['argv']!r}: {exc}\n")
        return 127
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = config["socket"]
    partial = path + ".partial"
    listener.bind(partial)
    os.chmod(partial, 0o777)
    listener.listen(8)
    os.rename(partial, path)  # the host connects once the name appears: never to a half-made socket
    target = relay_stdio if port is None else relay_port
    threading.Thread(target=target, args=(listener, proc if port is None else port), daemon=True).start()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
