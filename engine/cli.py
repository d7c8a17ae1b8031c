"""`palaestra engine serve`: run the embedded CPU engine (SGLang's native HTTP API).

    palaestra engine serve --model tiny --port 30001
    curl -s localhost:30001/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8}}'

Also `engine_process`, which starts the same command as a subprocess for tests, benchmarks and the demo.
"""

from __future__ import annotations

import argparse
import logging
import sys

from palaestra.net import ServerProcess, free_port

# The HTTP/2 connection preface (RFC 9113 §3.4), sent first by a client with prior knowledge.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def http1_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection that opens with the HTTP/2 preface
    without a word.

    sglang-router probes every worker it registers with that preface (its gRPC detection, beside
    `GET /health`); uvicorn answered each with `WARNING: Invalid HTTP request received.`, two
    lines per engine at every start behind a router. Any other malformed request still warns."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HTTP1Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _first_bytes = True

        def data_received(self, data: bytes) -> None:
            first, self._first_bytes = self._first_bytes, False
            if first and data.startswith(H2_PREFACE[:16]):
                self.transport.close()  # the prober reads "not gRPC" and goes on with HTTP/1.1
                return
            super().data_received(data)

    return HTTP1Protocol


def _serve(args: argparse.Namespace) -> int:
    from palaestra import quiet_server
    from palaestra.engine.server import EngineConfig, EngineServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("palaestra.engine").warning(
            "binding %s: the engine has no auth; keep it on a private network", args.host
        )
    # `palaestra` (palaestra/cli.py) turns a preset name into its directory: the presets live above
    # the engine, which takes a HF-format directory.
    model_path = args.model_dir or args.model
    config = EngineConfig(
        model_path=model_path,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        weight_version=args.weight_version,
        max_running_requests=args.max_running_requests,
        prefill_token_budget=args.prefill_token_budget,
        prefix_cache_mb=args.prefix_cache_mb,
        incremental_streaming_output=args.incremental_streaming_output,
        num_threads=args.num_threads,
        enable_lora=args.enable_lora or bool(args.lora_paths),
        lora_paths=list(args.lora_paths or []),
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        enable_return_routed_experts=args.enable_return_routed_experts,
        model_impl=args.model_impl,
    )
    server = EngineServer(config)
    print(
        f"palaestra engine: serving {args.model} ({model_path}) on http://{args.host}:{args.port}", flush=True
    )
    quiet_server.run(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        http=http1_protocol(),
    )
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="preset name (tiny, smollm2-135m) or a HF-format directory of a Llama/Qwen2 model",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument(
        "--weight-version",
        default="default",
        help="initial weight version string, as SGLang's --weight-version (default: %(default)s)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="most sequences decoded together in one batch; more wait (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=4096,
        help="prompt tokens prefilled per scheduler step before the next decode step, so long "
        "prompts do not stall running sequences; at least one request is always admitted "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=1024,
        help="memory for the prefix cache (KV of finished sequences) in MiB; 0 disables it "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas instead of cumulative text/ids/logprobs (SGLang's flag of the same name)",
    )
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    p.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "native", "transformers"],
        help="the modules that run the model: the engine's own for dense Llama-family models "
        "(native: starts without transformers' modeling code), transformers', or auto: native "
        "where it serves the model (default: %(default)s; SGLang's flag of the same name)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="MoE models: answer requests with return_routed_experts (SGLang's flag; docs/engine.md)",
    )
    lora = p.add_argument_group("LoRA adapters (SGLang's flags; docs/engine.md)")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: /load_lora_adapter, /unload_lora_adapter, lora_path in /generate "
        "(implied by --lora-paths)",
    )
    lora.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories loaded at start: NAME=PATH, PATH (named after its directory) "
        'or JSON {"lora_name": ..., "lora_path": ...}',
    )
    lora.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="most distinct adapters decoded together; a request of one more waits (default: %(default)s)",
    )
    lora.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="most adapters resident at once; a load beyond is refused (default: no limit)",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank (default: any rank)"
    )
    lora.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="refuse adapters of other projections, e.g. q_proj v_proj, or all (default: any)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: %(default)s)",
    )


def register(groups) -> None:
    engine = groups.add_parser(
        "engine",
        help="the embedded CPU inference engine",
        description="The embedded CPU inference engine (speaks SGLang's native HTTP API).",
    )
    sub = engine.add_subparsers(dest="engine_cmd", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over SGLang's native HTTP API",
        description="Serve a causal LM on CPU with SGLang's native HTTP API: /generate (batched decoding, "
        "prefix cache, logprobs, scoring with max_new_tokens=0), /abort_request, "
        "/pause_generation, /continue_generation, /flush_cache, /update_weights_from_disk, "
        "/update_weights_from_tensor, /update_weight_version, /get_weight_version, "
        "/load_lora_adapter, /unload_lora_adapter (with --enable-lora), /health, "
        "/server_info, /model_info, /v1/models and Prometheus /metrics. See docs/engine.md.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve, model_dir=None)  # model_dir: filled from --model by palaestra/cli.py


def engine_process(
    model: str = "tiny",
    port: int | None = None,
    extra_args: list[str] | None = None,
    startup_timeout: float = 180.0,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> ServerProcess:
    """`palaestra engine serve` as a subprocess (call `.start()` or use `with`), bound to `host`
    (loopback by default) on `port` (a free one by default); its URL names `host`, or loopback
    when `host` is a wildcard address."""
    picked = ["--port"] if not port else []
    port = port or free_port()
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    argv = [
        sys.executable,
        "-m",
        "palaestra.cli",
        "engine",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *(extra_args or []),
    ]
    url = f"http://[{reach}]:{port}" if ":" in reach else f"http://{reach}:{port}"
    return ServerProcess(
        argv, url, name=f"engine-{port}", startup_timeout=startup_timeout, env=env, free_ports=picked
    )
