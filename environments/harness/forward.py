"""Runs a harness inside its sandbox behind the session tunnel: the sandbox's one way out.

Not imported by the host: `env.py` copies this file into the episode's run directory, which is
mounted read-only at /run/palaestra in the sandbox, and starts it as one exec,
``python3 -I -S /run/palaestra/forward.py`` (stdlib only), with a JSON object on stdin:

    {"socket": "/run/palaestra/tunnel.sock", "port": 8080, "stop": "/run/palaestra/stop",
     "argv": ["/opt/harness/claude-code/.../claude", "-p", "..."], "env": {...}, "cwd": "/work/repo",
     "mkdirs": ["/work/home"]}

It listens on 127.0.0.1:``port`` of the sandbox's own network namespace (the sandbox has no other
network) and relays every connection, byte for byte, to the unix socket of the host's
`SessionTunnel`, which forwards only this session's routes to the gateway. Then it runs the harness
(``argv`` with ``env``, stdin closed, its own process group) and exits with the harness's status.
When the host creates the ``stop`` file (the episode's turn budget is spent) it kills the harness's
process group and exits with `STOPPED`. The token travels on stdin, not in an argv or a file.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

STOPPED = 124
"""Exit status when the host stopped the harness (its turn budget was spent)."""
POLL_S = 0.2


def relay(src, dst):
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def serve(listener, path):
    while True:
        conn, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError as exc:
            sys.stderr.write(f"forward: tunnel {path} refused a connection: {exc}\n")
            conn.close()
            upstream.close()
            continue
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=relay, args=(a, b), daemon=True).start()


def main():
    config = json.load(sys.stdin)
    for path in config.get("mkdirs", ()):
        os.makedirs(path, exist_ok=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", config["port"]))  # listening before the harness starts: no race
    listener.listen(64)
    threading.Thread(target=serve, args=(listener, config["socket"]), daemon=True).start()
    proc = subprocess.Popen(
        config["argv"],
        env=config["env"],
        cwd=config.get("cwd") or None,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    while proc.poll() is None:
        if os.path.exists(config["stop"]):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sys.stderr.write("forward: the harness was stopped: its turn budget is spent\n")
            sys.exit(STOPPED)
        time.sleep(POLL_S)
    code = proc.returncode
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
