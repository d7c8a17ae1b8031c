"""`palaestra gateway serve`: the OpenAI-compatible, token-recording gateway.

Also `gateway_process(...)`, the same command as a subprocess for tests, benchmarks and demos.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from palaestra.net import ServerProcess, free_port


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from palaestra.gateway.app import create_app
    from palaestra.gateway.state import GatewayConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    config = GatewayConfig(**{k: v for k, v in vars(args).items() if k in fields})
    app = create_app(config)
    print(
        f"palaestra gateway: http://{config.host}:{config.port} -> engine {config.engine_url}; "
        f"samples spooled to {config.spool_dir}",
        flush=True,
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, access_log=False)
    return 0


def register(groups) -> None:
    gateway = groups.add_parser(
        "gateway",
        help="the OpenAI-compatible gateway",
        description="The OpenAI-compatible gateway that records exact tokens.",
    )
    sub = gateway.add_subparsers(dest="gateway_cmd", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "serve",
        help="serve the gateway",
        description="Serve OpenAI routes under /s/<session>/v1 (chat/completions, completions, models), the session "
        "API (/sessions, /sessions/<id>/reward, /sessions/<id>), /samples and /samples/stream for the "
        "trainer, /admin/pause and /admin/resume, /metrics and /health. Prompts are rendered to token ids "
        "with the model's chat template and sent to the engine's /generate with X-SMG-Routing-Key. "
        "See docs/gateway.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="preset name or HF directory: its tokenizer and chat template"
    )
    p.add_argument(
        "--engine-url", required=True, help="sglang-router URL (or one engine's) speaking SGLang /generate"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--public-url", default=None, help="base URL put into session base_urls (default: as requested)"
    )
    p.add_argument("--api-key", default=None, help="the run's API key (or env PALAESTRA_API_KEY)")
    p.add_argument(
        "--admin-key", default=None, help="admin key for /admin routes (or env PALAESTRA_ADMIN_KEY)"
    )
    p.add_argument(
        "--insecure-local", action="store_true", help="serve without keys (loopback development only)"
    )
    p.add_argument("--spool-dir", default="runs/spool", help="directory of the durable sample spool")
    p.add_argument("--served-model-name", default=None, help="model name in answers (default: --model)")
    p.add_argument(
        "--tool-parser",
        default="auto",
        help="tool-call parser: auto (from the chat template), hermes, glm45, none, or module:attr",
    )
    p.add_argument(
        "--reasoning-parser", default="auto", help="reasoning parser: auto, qwen3, deepseek-r1, glm45, none"
    )
    p.add_argument(
        "--reasoning-policy",
        default="strip",
        choices=["strip", "keep"],
        help="when the template drops earlier reasoning: strip = fork a new sample (template-faithful), "
        "keep = continue on the exact tokens",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=4096,
        help="max tokens per call when the request sets none (capped by the context)",
    )
    p.add_argument("--context-length", type=int, default=None, help="default: the engine's /server_info")
    p.add_argument(
        "--pause-mode",
        default="wait",
        choices=["wait", "reject"],
        help="while paused, new calls wait (up to --pause-wait-s) or get 429 with Retry-After",
    )
    p.add_argument("--pause-wait-s", type=float, default=600.0, help="longest wait of a call while paused")
    p.add_argument("--retry-after-s", type=int, default=5, help="Retry-After seconds on 429")
    p.add_argument("--engine-timeout-s", type=float, default=600.0, help="timeout of one engine call")
    p.add_argument(
        "--engine-retries",
        type=int,
        default=2,
        help="retries of an engine call that committed no tokens (connection refused, 5xx)",
    )
    p.add_argument(
        "--engine-incremental-stream",
        action="store_true",
        help="the engines run with --incremental-streaming-output (deltas instead of cumulative)",
    )
    p.add_argument(
        "--max-sessions", type=int, default=10_000, help="sessions kept in memory (finished ones evicted)"
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_serve)


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
        argv, f"http://127.0.0.1:{port}", name=f"gateway-{port}", env=env, startup_timeout=startup_timeout
    )
