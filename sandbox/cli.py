"""`palaestra sandbox exec`, `palaestra sandbox serve` and `palaestra sandbox build-images`.

    palaestra sandbox exec --upload solution.py --json -- python3 solution.py
    palaestra sandbox exec --backend http://127.0.0.1:8100 --timeout 5 -- sh -c 'echo hi'
    palaestra sandbox serve --port 8100 --api-key KEY
    palaestra sandbox build-images                 # docker images, offline (images/build.py)

``exec`` runs one command in a fresh sandbox (the uploaded files in its work directory), prints
its stdout and stderr (or, with ``--json``, one JSON object: the ExecResult) and exits with the
command's exit code, or 124 (timeout), 125 (output_limit), 126 (error), 137 (memory); 1 with a
message when the sandbox itself failed (backend unreachable, wrong key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from palaestra.sandbox.base import Limits

STATUS_EXIT = {"timeout": 124, "output_limit": 125, "error": 126, "memory": 137}
API_KEY_ENV = "PALAESTRA_SANDBOX_API_KEY"


async def run_exec(args: argparse.Namespace) -> int:
    from palaestra.sandbox.backends import get_backend

    if not args.command:
        raise SystemExit("palaestra sandbox exec: give the command after '--'")
    files = {}
    for name in args.upload or []:
        path = Path(name)
        if not path.is_file():
            raise SystemExit(f"palaestra sandbox exec: --upload {name}: no such file")
        files[path.name] = path.read_bytes()
    fields = {"timeout_s": args.timeout}
    if args.memory_mb is not None:
        fields["memory_mb"] = args.memory_mb
    limits = Limits(**fields)
    backend = get_backend(args.backend, api_key=args.api_key)
    stdin = sys.stdin.buffer.read() if args.stdin else None
    try:
        async with await backend.create("python", limits) as box:
            for name, data in files.items():
                await box.upload(name, data)
            result = await box.exec(args.command, stdin=stdin, timeout=args.timeout)
    finally:
        await backend.close()
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.status != "ok" or result.stdout_truncated or result.stderr_truncated:
            cut = " (output truncated)" if result.stdout_truncated or result.stderr_truncated else ""
            print(f"[sandbox] {result.status}: {result.detail}{cut}", file=sys.stderr)
    if result.status != "ok":
        return STATUS_EXIT[result.status]
    code = result.exit_code or 0
    return code if code >= 0 else 128 - code


def _exec(args: argparse.Namespace) -> int:
    from palaestra.sandbox.base import SandboxError

    try:
        return asyncio.run(run_exec(args))
    except (SandboxError, ValueError) as exc:  # the sandbox or backend failed, not the command
        print(f"palaestra sandbox exec: {exc}", file=sys.stderr)
        return 1


async def run_server(args: argparse.Namespace) -> None:
    from palaestra.sandbox.backends import get_backend
    from palaestra.sandbox.server import ExecServer

    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if not api_key:
        raise SystemExit(f"palaestra sandbox serve: an API key is required (--api-key or ${API_KEY_ENV})")
    server = ExecServer(
        get_backend(args.backend, label=args.label),
        api_key,
        max_sandboxes=args.max_sandboxes,
        idle_timeout_s=args.idle_timeout,
    )
    host, port = await server.start(args.host, args.port, uds=args.uds)
    enforced = getattr(server.backend, "enforced", "")
    where = f"unix:{host}" if args.uds else f"http://{host}:{port}"
    print(f"palaestra sandbox server: {where} ({args.backend} backend) {enforced}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = loop.create_task(server.serve_forever())
    await stop.wait()
    serving.cancel()
    await server.close()


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(run_server(args))
    return 0


def register(groups) -> None:
    sandbox = groups.add_parser(
        "sandbox",
        help="run untrusted code in sandboxes; serve them over HTTP",
        description="Isolated execution of model-written code. See docs/sandbox.md.",
    )
    add_commands(sandbox)


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``exec``, ``serve`` and ``build-images`` under ``parser`` (``palaestra sandbox`` or
    ``python -m palaestra.sandbox``)."""
    sub = parser.add_subparsers(dest="sandbox_cmd", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "exec",
        help="run one command in a fresh sandbox",
        description="Run one command in a fresh sandbox, with the uploaded files in its work directory "
        "(/work), and print the result. Exit code: the command's, or 124 timeout, 125 output_limit, "
        "126 error (could not start), 137 memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend", default="local", help="local (bubblewrap), docker, or the URL of an exec server"
    )
    p.add_argument("--api-key", default=None, help=f"exec server key (or ${API_KEY_ENV}); URL backends only")
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit, seconds")
    p.add_argument("--memory-mb", type=int, default=None, help="memory limit, MiB (default: Limits' 512)")
    p.add_argument("--upload", nargs="+", metavar="FILE", help="files copied into the work directory")
    p.add_argument("--stdin", action="store_true", help="pass this command's stdin to the sandboxed one")
    p.add_argument("--json", action="store_true", help="print one JSON object (the ExecResult)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after '--'")
    p.set_defaults(func=_exec_entry)

    s = sub.add_parser(
        "serve",
        help="serve sandboxes over HTTP (the exec server)",
        description="Serve one backend's sandboxes over HTTP behind an API key: create, exec, upload, "
        "download, reset, close, health. RemoteBackend (or --backend URL) is the client.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=int, default=8100, help="TCP port")
    s.add_argument(
        "--uds", default=None, metavar="PATH", help="serve on this unix socket instead of host:port"
    )
    s.add_argument("--backend", default="local", help="backend whose sandboxes are served: local or docker")
    s.add_argument("--api-key", default=None, help=f"required key (or ${API_KEY_ENV})")
    s.add_argument(
        "--label",
        default="palaestra-sandbox",
        help="label of the sandboxes this server starts (leak cleanup)",
    )
    s.add_argument("--max-sandboxes", type=int, default=64, help="most sandboxes held at once")
    s.add_argument(
        "--idle-timeout", type=float, default=900.0, help="close sandboxes unused this long, seconds"
    )
    s.add_argument("--log-level", default="info", help="logging level")
    s.set_defaults(func=_serve)

    from palaestra.sandbox.images.build import add_arguments

    b = sub.add_parser(
        "build-images",
        help="build the docker images offline (sandbox, exec server, app)",
        description="Build the docker backend's and the compose fleet's images from this host's files, "
        "offline; an image whose inputs did not change is found by its content tag and not rebuilt.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(b)
    b.set_defaults(func=_build_images)


def _build_images(args: argparse.Namespace) -> int:
    from palaestra.sandbox.images import build

    return build.run(args)


def _exec_entry(args: argparse.Namespace) -> int:
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.timeout <= 0:
        raise SystemExit(f"palaestra sandbox exec: --timeout must be positive; got {args.timeout}")
    return _exec(args)
