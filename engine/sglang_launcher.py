"""Launch a real SGLang server with its own options passed through.

    palaestra sglang launch --model Qwen/Qwen3-0.6B --port 30001 \\
        --sglang-tp-size 2 --sglang-mem-fraction-static 0.8 --sglang-enable-memory-saver
    palaestra sglang launch --model ... --dry-run      # print the command, start nothing

Every `--sglang-foo-bar [V]` becomes SGLang's own `--foo-bar [V]` (`--sglang-foo=V` becomes
`--foo=V`); flags without a value stay flags. There is no wrapper around SGLang's option names:
`python -m sglang.launch_server --help` is the reference. Our own options are only `--model`
(SGLang's `--model-path`), `--host` (127.0.0.1) and `--port`.

SGLang needs a CUDA/ROCm GPU host (or, for its CPU backend, an AVX-512 CPU). Where it is not
installed, `launch` fails and points at the embedded engine, which speaks the same HTTP API.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from collections.abc import Mapping, Sequence

from palaestra.net import LOOPBACK, ServerProcess

__all__ = ["SGLangUnavailable", "build_command", "launch", "register", "translate_passthrough"]

PREFIX = "--sglang-"
# 30000 is SGLang's own default and also the router's; the worker takes the next port.
DEFAULT_PORT = 30001
DEFAULT_STARTUP_TIMEOUT = 1800.0  # large checkpoints take minutes to load
# Passthrough flags that duplicate one of our options -> the option to use instead.
OWNED_PASSTHROUGH = {
    "--sglang-model-path": "--model",
    "--sglang-host": "--host",
    "--sglang-port": "--port",
}
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _looks_like_option(token: str) -> bool:
    # argparse's rule: negative numbers and strings with a space are values, not options.
    return token.startswith("-") and not _NEGATIVE_NUMBER.match(token) and " " not in token


class SGLangUnavailable(RuntimeError):
    """SGLang is not importable by the interpreter that would run it."""


def translate_passthrough(passthrough: Sequence[str]) -> list[str]:
    """`--sglang-*` arguments -> SGLang's own arguments; values (anything else) are kept as they are.

    Raises ValueError for an argument that is neither an `--sglang-*` flag nor a flag's value.
    """
    translated: list[str] = []
    for token in passthrough:
        is_option = _looks_like_option(token)
        if not is_option:
            if not translated:
                raise ValueError(f"unrecognized argument {token!r}")
            translated.append(token)
            continue
        flag = token.split("=", 1)[0]
        if not flag.startswith(PREFIX) or flag == PREFIX:
            raise ValueError(
                f"unrecognized argument {token!r}: SGLang options pass through as "
                f"--sglang-<option> (see `python -m sglang.launch_server --help`)"
            )
        if flag in OWNED_PASSTHROUGH:
            raise ValueError(f"{flag} is not accepted: use {OWNED_PASSTHROUGH[flag]}")
        translated.append("--" + token[len(PREFIX) :])
    return translated


def build_command(
    model: str,
    host: str = LOOPBACK,
    port: int = DEFAULT_PORT,
    passthrough: Sequence[str] = (),
    *,
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts SGLang's server for `model` on host:port."""
    return [
        python, "-m", "sglang.launch_server",
        "--model-path", model,
        "--host", host,
        "--port", str(port),
        *translate_passthrough(passthrough),
    ]  # fmt: skip


def unavailable_reason() -> str | None:
    """Why SGLang cannot be launched from this interpreter, or None if it can."""
    if importlib.util.find_spec("sglang") is not None:
        return None
    return (
        f"SGLang is not installed for {sys.executable}. SGLang needs a GPU host (CUDA/ROCm) or, "
        f"for its CPU backend, an AVX-512 CPU{_avx512_note()}. Install it there "
        "(`pip install sglang`), or on this machine use the embedded engine, which serves the "
        "same HTTP API: `palaestra engine serve`."
    )


def _avx512_note() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return ""
    return " (this CPU has AVX-512)" if "avx512f" in flags else " (this CPU has no AVX-512)"


def launch(
    model: str,
    host: str = LOOPBACK,
    port: int = DEFAULT_PORT,
    passthrough: Sequence[str] = (),
    *,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    log_path: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start SGLang and wait until `GET /health` answers; return the running process.

    Raises SGLangUnavailable if SGLang is not importable, ValueError for a bad passthrough, and
    palaestra.net.ServerStartError (with the log tail) if the server dies or times out.
    """
    argv = build_command(model, host, port, passthrough)  # validate before anything else
    reason = unavailable_reason()
    if reason is not None:
        raise SGLangUnavailable(reason)
    return ServerProcess(
        argv,
        f"http://{host}:{port}",
        name="sglang",
        ready_path="/health",
        startup_timeout=startup_timeout,
        log_path=log_path,
        env=env,
    ).start()


def register(groups: argparse._SubParsersAction) -> None:
    """Add `palaestra sglang launch` to the top-level command groups."""
    sglang = groups.add_parser("sglang", help="a real SGLang server (GPU host)")
    commands = sglang.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser = commands.add_parser(
        "launch",
        help="start `python -m sglang.launch_server` with --sglang-* options passed through",
        description=(
            "Start SGLang's server and wait until GET /health answers. Every --sglang-foo-bar [V] "
            "is passed on as SGLang's own --foo-bar [V]."
        ),
        epilog=(
            "SGLang options: any of `python -m sglang.launch_server --help`, written with a\n"
            "--sglang- prefix, e.g. --sglang-tp-size 2 --sglang-enable-memory-saver.\n"
            "--sglang-model-path, --sglang-host and --sglang-port are not accepted: use the\n"
            "options above. Without SGLang (no GPU / AVX-512 CPU) use `palaestra engine serve`."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model path or HF id (SGLang's --model-path)")
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT,
        help="seconds to wait for GET /health (default: %(default)s)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")

    def command(args: argparse.Namespace, extra: Sequence[str]) -> int:
        try:
            argv = build_command(args.model, args.host, args.port, extra)
        except ValueError as exc:
            parser.error(str(exc))  # exits 2 with our usage line
        if args.dry_run:
            print(shlex.join(argv))
            return 0
        try:
            server = launch(args.model, args.host, args.port, extra, startup_timeout=args.startup_timeout)
        except SGLangUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"sglang: {server.url} (log: {server.log_path}); Ctrl-C to stop", file=sys.stderr)
        try:
            server.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
        return 0

    parser.set_defaults(func=command, accepts_extra=True)
