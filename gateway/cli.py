"""`palaestra gateway serve`: the OpenAI-compatible, token-recording gateway.

Its flags are `GatewayConfig`'s fields (gateway/config.py and, for those a run tunes,
gateway/options.py), generated with their docstrings as help, so they are declared once. The spool
directory's default (`runs/spool`) is relative to where the gateway starts; `--help` says so.
Also `gateway_process(...)`, the same command as a subprocess for tests, benchmarks and demos.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.engine_side.placement import PlacementConfig
from palaestra.gateway.options import GatewayOptions
from palaestra.net import ServerProcess, free_port
from palaestra.typed_config import add_arguments, field_docs


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` that `palaestra gateway serve` parsed into `args`."""
    placement = PlacementConfig(
        **{f.name: getattr(args, f"placement_{f.name}") for f in dataclasses.fields(PlacementConfig)}
    )
    return GatewayConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(GatewayConfig)
            if f.name not in ("placement", "shards")
        },
        placement=placement,
    )


TORCH_ENV = "PALAESTRA_GATEWAY_TORCH"


def build_app(config: GatewayConfig, create_app: Callable[[GatewayConfig], Any]) -> Any:
    """`create_app(config)` in a process that never imports torch, unless it already has.

    The gateway needs the model's tokenizer, chat template and config, never its weights, but
    `AutoTokenizer` reaches torch through transformers' configuration module: ~1 s of CPU (~2 s
    without bytecode caches) and ~180 MB resident at every gateway start for nothing
    (docs/gateway.md, "Starting without torch"). With `torch` marked absent in `sys.modules`, transformers finds no torch and loads the
    same tokenizer classes from the same files. A preset is resolved first, since building it on
    first use does need torch. `PALAESTRA_GATEWAY_TORCH=1` keeps torch for a tokenizer that imports
    it; without it such a tokenizer stops the start with a one-line error saying so."""
    from palaestra.models import resolve_model

    if os.environ.get(TORCH_ENV) == "1" or "torch" in sys.modules:
        return create_app(config)
    resolve_model(config.model)
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails; find_spec: absent
    # transformers warns at import that it found no torch and serves tokenizers only: that is the point
    advisory = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    was = os.environ.get(advisory)
    os.environ[advisory] = "1"
    try:
        import transformers  # noqa: F401  (imported with that warning off)
    finally:
        if was is None:
            del os.environ[advisory]
        else:
            os.environ[advisory] = was
    try:
        return create_app(config)
    except ImportError as exc:
        if "torch" not in str(exc):
            raise
        raise SystemExit(
            f"palaestra gateway: loading {config.model!r} needs torch ({exc}); start the gateway with "
            f"{TORCH_ENV}=1"
        ) from None


def _serve(args: argparse.Namespace) -> int:
    from palaestra import quiet_server
    from palaestra.gateway.app import create_app
    from palaestra.gateway.event_loop import loop_name
    from palaestra.gateway.http_writes import HeadJoiningProtocol

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # the gateway tokenizes one text at a time: no thread pool (renderer._without_offsets)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = config_from_args(args)
    # Start-up's objects live as long as the process, so the collector runs once they are all made
    # (below), not on the way: building the app (the tokenizer's libraries, torch too before `build_app`) made
    # three full collections and ~450 young ones, each full one walking all that was imported before
    # it (start-up's collections: 0.50-0.53 s of CPU, now 0.27-0.35 s; docs/gateway.md).
    gc.disable()
    try:
        app = build_app(config, create_app)
    finally:
        gc.enable()
    # What start-up made (~280k objects: the modules, the tokenizer, the app) lives as long as the
    # process: out of the collector's reach, a full collection walks only what serving made. Before,
    # each of them walked it all, 100-170 ms with the event loop stopped, and one fell due whenever
    # the sessions' kept objects had grown by a quarter of it (docs/gateway.md).
    gc.collect()
    gc.freeze()
    print(
        f"palaestra gateway: http://{config.host}:{config.port} -> engine {config.engine_url}; "
        f"samples and session journal in {Path(config.spool_dir).resolve()}",
        flush=True,
    )
    loop = loop_name(config.event_loop, "palaestra gateway serve")
    quiet_server.run(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        access_log=False,
        loop=loop,
        http=HeadJoiningProtocol,  # an answer's head and body in one write (gateway/http_writes.py)
    )
    return 0


SPOOL_NOTE = (
    "Where samples go: --spool-dir holds the durable sample spool and the session journal. Its "
    "default, runs/spool, is relative to the directory the gateway starts in (the start line prints "
    "the absolute path); give a restarted gateway the same directory and it continues every open "
    "session and serves every spooled sample. `palaestra train` gives its gateway <output dir>/spool "
    "(runs/<run.name>/spool)."
)


def register(groups: argparse._SubParsersAction) -> None:
    gateway = groups.add_parser(
        "gateway",
        help="the OpenAI- and Anthropic-compatible gateway",
        description="The gateway that agents call in their own API (OpenAI Chat Completions, "
        "completions, Responses; Anthropic Messages) and that records exact tokens.",
    )
    sub = gateway.add_subparsers(dest="gateway_cmd", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "serve",
        help="serve the gateway",
        description="Serve the agent routes under /s/<session>/v1 (OpenAI: chat/completions, completions, "
        "responses, models; Anthropic: messages, messages/count_tokens) and the same under /v1 with the "
        "session named by an X-Session-ID header (created on first sight under the environment key), the session "
        "API (/sessions, /sessions/<id>/reward, /sessions/<id>), /samples and /samples/stream for the "
        "trainer, /admin/pause and /admin/resume, /metrics and /health. Prompts are rendered to token ids "
        "with the model's chat template and sent to the engine's /generate with X-SMG-Routing-Key. "
        "See docs/gateway.md.",
        epilog=SPOOL_NOTE,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tunable = {f.name for f in dataclasses.fields(GatewayOptions)}
    topology = ("placement", "shards")  # a section of its own; the run's topology (gateway/shards.py)
    add_arguments(
        p, GatewayConfig, [f.name for f in dataclasses.fields(GatewayConfig) if f.name not in tunable]
    )
    tuned = p.add_argument_group("options a run tunes (its config's gateway: section)")
    add_arguments(
        tuned, GatewayOptions, [f.name for f in dataclasses.fields(GatewayOptions) if f.name not in topology]
    )
    placed = p.add_argument_group(
        "placement (its config's gateway.placement: section)", field_docs(GatewayOptions)["placement"]
    )
    placed.add_argument(  # by hand: a bare --placement-enabled (its earlier bool form) still means on
        "--placement-enabled",
        dest="placement_enabled",
        choices=["auto", "on", "off"],
        nargs="?",
        const="on",
        default=PlacementConfig.enabled,
        help=" ".join(field_docs(PlacementConfig)["enabled"].split()),
    )
    placed.add_argument(
        "--placement", dest="placement_enabled", action="store_const", const="on", help="= on"
    )
    placed.add_argument(
        "--no-placement", dest="placement_enabled", action="store_const", const="off", help="= off"
    )
    others = [f.name for f in dataclasses.fields(PlacementConfig) if f.name != "enabled"]
    add_arguments(placed, PlacementConfig, others, prefix="placement_")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_serve)
    f = sub.add_parser(
        "front",
        help="forward each session's calls to the gateway shard that owns it",
        description="The front of N gateway shards (each a `palaestra gateway serve` with its own "
        "--spool-dir): every request goes to the shard that owns its session (a hash of the session "
        "id), streams come back unchanged, /admin/pause|resume go to every shard, /metrics answers "
        "every shard's series with a shard label, /samples* take ?shard=<i>. Holds no key: the shards "
        "check them. See gateway/shards.py and docs/gateway.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    f.add_argument(
        "--shard-url", action="append", required=True, help="a shard's URL, once per shard, in shard order"
    )
    f.add_argument("--host", default="127.0.0.1", help="Bind address.")
    f.add_argument("--port", type=int, default=8000, help="TCP port.")
    f.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="auto = uvloop where installed, else asyncio's (as gateway serve's --event-loop).",
    )
    f.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    f.set_defaults(func=_front)


def _front(args: argparse.Namespace) -> int:
    from palaestra.gateway.shards import serve_front

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_front(args.shard_url, args.host, args.port, event_loop=args.event_loop)
    return 0


def gateway_process(
    model: str,
    engine_url: str,
    spool_dir: str,
    *,
    port: int | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    startup_timeout: float = 120.0,
) -> ServerProcess:
    picked = ["--port"] if not port else []
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "palaestra.cli",
        "gateway",
        "serve",
        "--model",
        model,
        "--engine-url",
        engine_url,
        "--port",
        str(port),
        "--spool-dir",
        spool_dir,
        *(extra_args or []),
    ]
    return ServerProcess(
        argv,
        f"http://127.0.0.1:{port}",
        name=f"gateway-{port}",
        env=env,
        startup_timeout=startup_timeout,
        free_ports=picked,
    )
