"""Launch the real sglang-router (SGLang Model Gateway, "smg", Rust) in front of engine workers.

    palaestra router serve --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --router-health-check-interval-secs 5

Every worker is an SGLang server or the embedded engine; the gateway sends `X-SMG-Routing-Key:
<session>` and the router's `consistent_hashing` policy keeps a session on one worker (and its
prefix cache). sglang-router 0.3.2's own CLI cannot select that policy (its `--policy` choices
omit it), so we build `RouterArgs` ourselves and start `Router.from_args(...)` in-process.

Our options: `--worker-urls`, `--host`, `--port`, `--policy`, `--prometheus-host`,
`--prometheus-port`, `--log-level`; everything bound to 127.0.0.1 by default. Every other router
option passes through under its own name with a `--router-` prefix (the prefixed flags of
`RouterArgs.add_cli_args(use_router_prefix=True)`); the four prefixed flags that duplicate ours
(`--router-policy`, `--router-prometheus-host`, `--router-prometheus-port`, `--router-log-level`)
are rejected so they can never silently disagree with them.

What the router (0.3.2) does with a worker, measured against a stand-in (tests/engine/test_launchers.py):
registration probes `GET /health`, an HTTP/2 prior-knowledge `PRI *` (gRPC detection; plain
uvicorn logs "Invalid HTTP request received", the embedded engine closes it quietly), then `GET /server_info` and `GET /model_info`; after that
`GET /health` every `--router-health-check-interval-secs`. Its own `GET /health` answers 200 at
once, before any worker is registered; `GET /readiness` reports `healthy_workers` /
`total_workers`, so `RouterProcess` waits on that. `POST /generate` is parsed into smg's typed
request and re-serialised: the `X-SMG-Routing-Key` header is forwarded, unknown fields are dropped
and defaults are added (see the routing test for the exact body).

`RouterProcess` runs `python -m palaestra.engine.router router serve ...` (the same argv as
`palaestra router serve`, without importing the other command groups) for tests, bench and demos.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence

import httpx
from sglang_router.router_args import RouterArgs

from palaestra.net import LOOPBACK, ServerProcess, free_port

__all__ = [
    "OWNED_PASSTHROUGH",
    "POLICIES",
    "RouterProcess",
    "build_router_args",
    "passthrough_parser",
    "register",
    "serve",
]

PREFIX = "--router-"
DEFAULT_PORT = 30000
# Every policy sglang_router.router.policy_from_str knows; 0.3.2's CLI offers only some of them.
POLICIES = (
    "consistent_hashing",
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "prefix_hash",
    "bucket",
    "manual",
)
LOG_LEVELS = ("debug", "info", "warn", "error")
# At info smg logs every request twice ("started processing request", "finished processing
# request", coloured): warn keeps what needs a reader.
DEFAULT_LOG_LEVEL = "warn"
# Prefixed passthrough flags that duplicate one of our options -> the option to use instead.
OWNED_PASSTHROUGH = {
    "--router-policy": "--policy",
    "--router-prometheus-host": "--prometheus-host",
    "--router-prometheus-port": "--prometheus-port",
    "--router-log-level": "--log-level",
}
# argparse's own test for "this token is a negative number, i.e. a value, not an option".
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class _DefaultsExceptSecretsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where RouterArgs reads them from the environment (passwords, DB URLs)."""

    _SECRET = re.compile(r"password|username|url|wallet|dsn|descriptor|tns")

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if self._SECRET.search(action.dest):
            return action.help
        return super()._get_help_string(action)


def passthrough_parser() -> argparse.ArgumentParser:
    """The router's own options, `--router-` prefixed, on a parser of their own.

    `add_cli_args(use_router_prefix=True)` still adds an unprefixed `--worker-urls`, which is
    ours; it and the flags in OWNED_PASSTHROUGH are hidden from the help.
    """
    parser = argparse.ArgumentParser(
        prog="palaestra router serve",
        usage=argparse.SUPPRESS,
        add_help=False,
        allow_abbrev=False,  # a misspelt router flag must fail, not match a longer one
        exit_on_error=False,
        formatter_class=_DefaultsExceptSecretsFormatter,
    )
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    hidden = {"worker_urls"} | {flag[2:].replace("-", "_") for flag in OWNED_PASSTHROUGH}
    for action in parser._actions:  # argparse has no public way to hide an added option
        if action.dest in hidden:
            action.help = argparse.SUPPRESS
    return parser


def _check_extra(extra: Sequence[str]) -> None:
    """Everything our parser did not know must be `--router-*` flags and their values."""
    expecting_option = True
    for token in extra:
        flag = token.split("=", 1)[0]
        # argparse's rule: negative numbers and strings with a space are values, not options.
        if token.startswith("-") and not _NEGATIVE_NUMBER.match(token) and " " not in token:
            if not token.startswith(PREFIX):
                raise ValueError(
                    f"unrecognized argument {token!r}: router options pass through as "
                    f"--router-<option> (see `palaestra router serve --help`)"
                )
            if flag in OWNED_PASSTHROUGH:
                raise ValueError(
                    f"{flag} is not accepted: use {OWNED_PASSTHROUGH[flag]} (ours, so the two cannot disagree)"
                )
            expecting_option = False
        elif expecting_option:
            raise ValueError(f"unrecognized argument {token!r}")


def build_router_args(args: argparse.Namespace, extra: Sequence[str]) -> RouterArgs:
    """Combine our parsed options with the `--router-*` passthrough into a `RouterArgs`.

    Raises ValueError with a user-facing message for anything that is not a router option.
    """
    _check_extra(extra)
    parser = passthrough_parser()
    try:
        namespace, unknown = parser.parse_known_args(list(extra))
    except argparse.ArgumentError as exc:
        raise ValueError(f"bad router option: {exc}") from None
    if unknown:
        raise ValueError(
            f"unknown router option(s): {' '.join(unknown)} (see `palaestra router serve --help`)"
        )
    for url in args.worker_urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    router_args = RouterArgs.from_cli_args(namespace, use_router_prefix=True)
    return dataclasses.replace(
        router_args,
        worker_urls=list(args.worker_urls),
        host=args.host,
        port=args.port,
        policy=args.policy,
        prometheus_host=args.prometheus_host,
        prometheus_port=_prometheus_port(args.port, args.prometheus_port),
        log_level=args.log_level,
    )


def _prometheus_port(port: int, requested: int | None) -> int:
    if requested is not None:
        return requested
    return port + 10000 if port + 10000 <= 65535 else free_port()


def serve(router_args: RouterArgs) -> int:
    """Run the router in this process until SIGINT/SIGTERM."""
    from sglang_router.launch_router import launch_router

    print(
        f"router: http://{router_args.host}:{router_args.port} policy={router_args.policy} "
        f"metrics=http://{router_args.prometheus_host}:{router_args.prometheus_port}/metrics "
        f"workers={' '.join(router_args.worker_urls)}",
        file=sys.stderr,
        flush=True,
    )
    launch_router(router_args)  # blocks; validates, then Router.from_args(router_args).start()
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    """Add `palaestra router serve` to the top-level command groups."""
    router = groups.add_parser("router", help="the sglang-router in front of engine workers")
    commands = router.add_subparsers(dest="command", metavar="COMMAND", required=True)
    epilog = (
        "router options: sglang-router's own, under their own names with a --router- prefix.\n"
        "--router-policy, --router-prometheus-host, --router-prometheus-port and\n"
        "--router-log-level are not accepted: use the options above.\n\n" + passthrough_parser().format_help()
    )
    parser = commands.add_parser(
        "serve",
        help="run the real sglang-router (policy consistent_hashing) on loopback",
        description=(
            "Run sglang-router over the given workers. Requests carrying "
            "X-SMG-Routing-Key stick to one worker under the consistent_hashing policy."
        ),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--worker-urls", nargs="+", required=True, metavar="URL", help="engine worker base URLs"
    )
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--policy",
        default="consistent_hashing",
        choices=POLICIES,
        help="routing policy (default: %(default)s; sticky on X-SMG-Routing-Key)",
    )
    parser.add_argument(
        "--prometheus-host",
        default=LOOPBACK,
        help="address of the metrics server (default: %(default)s)",
    )
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help="port of the metrics server (default: --port + 10000, or a free port above 65535)",
    )
    parser.add_argument(
        "--log-level",
        default=DEFAULT_LOG_LEVEL,
        choices=LOG_LEVELS,
        help="router log level (default: %(default)s; info logs two lines per request)",
    )

    def command(args: argparse.Namespace, extra: Sequence[str]) -> int:
        try:
            router_args = build_router_args(args, extra)
        except ValueError as exc:
            parser.error(str(exc))  # exits 2 with our usage line
        return serve(router_args)

    parser.set_defaults(func=command, accepts_extra=True)


class RouterProcess(ServerProcess):
    """The real router as a subprocess, for tests, benchmarks and demos.

        with RouterProcess(["http://127.0.0.1:31001", "http://127.0.0.1:31002"]) as router:
            httpx.post(router.url + "/generate", json=..., headers={"X-SMG-Routing-Key": "s1"})

    `start()` returns once the router answers and (with `wait_for_workers`) every worker URL is
    registered and healthy (`GET /readiness`). `router_options` are `--router-*` passthrough
    arguments, e.g. `["--router-health-check-interval-secs", "1"]`.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        policy: str = "consistent_hashing",
        prometheus_port: int | None = None,
        log_level: str = DEFAULT_LOG_LEVEL,
        router_options: Sequence[str] = (),
        wait_for_workers: bool = True,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        log_path: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.worker_urls = list(worker_urls)
        self.host = host
        picked = [
            flag
            for flag, given in (("--port", port), ("--prometheus-port", prometheus_port))
            if given is None
        ]
        port = port if port is not None else free_port(host)
        prometheus_port = prometheus_port if prometheus_port is not None else free_port(host)
        argv = [
            sys.executable, "-m", "palaestra.engine.router", "router", "serve",
            "--worker-urls", *self.worker_urls,
            "--host", host,
            "--port", str(port),
            "--policy", policy,
            "--prometheus-host", host,
            "--prometheus-port", str(prometheus_port),
            "--log-level", log_level,
            *router_options,
        ]  # fmt: skip
        super().__init__(
            argv,
            f"http://{host}:{port}",
            name="router",
            ready_path="/readiness" if wait_for_workers else "/health",
            ready=self._all_workers_healthy if wait_for_workers else None,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            log_path=log_path,
            env=env,
            # smg logs every request at INFO, our readiness polls included.
            log_noise=r"uri=/(readiness|health) ",
            free_ports=picked,
        )

    @property
    def port(self) -> int:
        return self.port_of("--port")

    @property
    def prometheus_port(self) -> int:
        return self.port_of("--prometheus-port")

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}/metrics"

    def restart(self, extra_args: Sequence[str] = ()) -> RouterProcess:
        """The router again on its port; a ``--worker-urls`` in `extra_args` (the engines live now:
        one may have died or started again elsewhere since the first start) replaces the list it
        starts with and the workers its readiness waits for, so a dead engine's URL cannot hold
        the restart until it times out."""
        args = list(extra_args)
        if "--worker-urls" in args:
            start = args.index("--worker-urls") + 1
            end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
            self.worker_urls = args[start:end]
        super().restart(args)
        return self

    def _all_workers_healthy(self, response: httpx.Response) -> bool:
        # {"status":"ready","healthy_workers":2,"total_workers":2}; a worker that is not up yet is
        # simply missing from total_workers while the router retries its registration.
        return response.json().get("healthy_workers", 0) >= len(self.worker_urls)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m palaestra.engine.router router serve ...`: the router group on its own."""
    parser = argparse.ArgumentParser(prog="palaestra")
    register(parser.add_subparsers(dest="group", metavar="COMMAND", required=True))
    args, extra = parser.parse_known_args(argv)
    return int(args.func(args, extra) or 0)


if __name__ == "__main__":
    sys.exit(main())
