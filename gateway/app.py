"""The gateway app: wires one `GatewayService` (`build_service`) and mounts the routes over it.

    palaestra gateway serve --model tiny --engine-url http://127.0.0.1:30000 --port 8000 \
        --api-key $KEY --admin-key $ADMIN
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from palaestra.gateway import bridge, parsers
from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.dialects import template_caps
from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.engine_side.pause import PauseGate
from palaestra.gateway.engine_side.routing import EngineRouting, RoutingOptions
from palaestra.gateway.engine_side.turns import EngineTurns
from palaestra.gateway.errors import GatewayError, internal_error
from palaestra.gateway.guards import BodyLimit
from palaestra.gateway.header_sessions import bound
from palaestra.gateway.hot_routes import HotRoutes
from palaestra.gateway.metrics import GatewayMetrics
from palaestra.gateway.renderer import ChatRenderer
from palaestra.gateway.routes import admin, anthropic, error_body, openai, public, sessions
from palaestra.gateway.service import GatewayService, ModelText
from palaestra.gateway.sessions.journal import SessionJournal
from palaestra.gateway.sessions.limits import IdleReaper, Limits
from palaestra.gateway.sessions.session_store import SessionStore
from palaestra.gateway.sessions.spool import SampleSpool

log = logging.getLogger("palaestra.gateway")


def _engine_context_length(engine_url: str) -> int | None:
    try:
        info = httpx.get(f"{engine_url.rstrip('/')}/server_info", timeout=10, trust_env=False).json()
        return int(info["context_length"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return None


def model_text(config: GatewayConfig, tokenizer: Any, context_length: int) -> ModelText:
    """The renderer, parsers and template facts of `tokenizer` (parsers "auto": from its chat template)."""
    renderer = ChatRenderer(tokenizer, context_length=context_length)
    template = getattr(tokenizer, "chat_template", None) or ""
    auto_tool, auto_reason = parsers.detect_parsers(template if isinstance(template, str) else "")
    stop_text: dict[int, str] = {}
    for tid in getattr(tokenizer, "all_special_ids", []) or []:
        stop_text[int(tid)] = tokenizer.convert_ids_to_tokens(int(tid))
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        stop_text.setdefault(int(tid), str(tok))
    return ModelText(
        renderer=renderer,
        tool_parser=parsers.get_tool_parser(
            auto_tool if config.tool_parser == "auto" else config.tool_parser
        ),
        reasoning_parser=parsers.get_reasoning_parser(
            auto_reason if config.reasoning_parser == "auto" else config.reasoning_parser
        ),
        stop_text=stop_text,
        render_gaps=bridge.RenderGaps(renderer),
        append_renders=bridge.AppendRenders(renderer),
        caps=template_caps.probe(renderer),
    )


def build_service(
    config: GatewayConfig, tokenizer: Any, context_length: int, engine: EngineClient, spool: SampleSpool
) -> GatewayService:
    """The service and its collaborators over one tokenizer, engine client and spool; the session
    journal in the spool directory is replayed (`GatewayService.recover`), so a gateway restarted on
    it continues every open session."""
    metrics = GatewayMetrics()
    sessions = SessionStore(config.max_sessions, metrics)
    gate = PauseGate(config, metrics)
    if config.start_paused:
        gate.pause()
    journal = SessionJournal(
        spool.dir,
        fsync=config.journal_fsync,
        interval_s=config.journal_fsync_interval_ms / 1000,
        segment_bytes=config.journal_segment_bytes,
    )
    limits = Limits(config, sessions, spool, journal, metrics.registry)
    routing_options = RoutingOptions(
        placement=config.placement,
        routing_trace=config.routing_trace,
        direct=config.return_routed_experts,  # the router drops return_routed_experts: post to the worker
    )
    routing = EngineRouting(routing_options, config.engine_url, metrics.registry, engine.http.serves)
    turns = EngineTurns(engine, routing, gate, journal, metrics)
    text = model_text(config, tokenizer, context_length)
    svc = GatewayService(config, text, turns, sessions, journal, limits, spool, metrics)
    svc.recover()
    return svc


class GatewayApp(FastAPI):
    """The FastAPI app, served through `front` (set by `create_app`): the body limit, then the turn
    routes (`HotRoutes`), then FastAPI's own stack (`stack`) for everything else."""

    front: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await (self.front or self.stack)(scope, receive, send)

    async def stack(self, scope: Any, receive: Any, send: Any) -> None:
        """FastAPI's middleware stack, routing and dependencies."""
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, tokenizer: Any | None = None) -> FastAPI:
    """Builds the app. `tokenizer` defaults to the model's (preset name or HF directory)."""
    from transformers import AutoConfig, AutoTokenizer

    from palaestra.models import resolve_model

    config.resolve_keys()
    if config.max_body_bytes < 1 or config.stream_send_timeout_s <= 0:
        raise SystemExit("palaestra gateway: --max-body-bytes and --stream-send-timeout-s must be positive")
    routed_experts = None
    if config.return_routed_experts:  # the rows of SGLang's routed_experts: layers x top_k
        model_config = AutoConfig.from_pretrained(resolve_model(config.model))
        routed_experts = (int(model_config.num_hidden_layers), int(model_config.num_experts_per_tok))
    if tokenizer is None or config.context_length is None:
        model_dir = resolve_model(config.model)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        if config.context_length is None:
            config.context_length = _engine_context_length(config.engine_url) or int(
                getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", 4096)
            )
    engine = EngineClient(
        config.engine_url,
        timeout_s=config.engine_timeout_s,
        retries=config.engine_retries,
        max_connections=config.engine_max_connections,
        incremental_stream=config.engine_incremental_stream,
        lora_adapter=config.engine_lora_adapter,
        routed_experts=routed_experts,
        engine_http=config.engine_http,
    )
    spool = SampleSpool(config.spool_dir, config.spool_segment_bytes, not config.spool_keep_acked)
    svc = build_service(config, tokenizer, config.context_length, engine, spool)  # replays the journal
    if any(svc.recovered.values()):
        log.warning("session journal replayed: %s", svc.recovered)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        reaper = asyncio.create_task(IdleReaper(svc.limits, svc.finish).run())
        await svc.routing.start()  # with placement: the router's worker list, then kept fresh
        yield
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await svc.routing.close()
        await engine.close()
        svc.close()
        spool.close()

    # FastAPI's own OpenTelemetry instrumentation off: nothing here configures a provider, so it only
    # looked the three providers up again on every request to find that out (the gateway's
    # metrics are its Prometheus ones, `metrics.py`)
    app = GatewayApp(
        title="palaestra gateway",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = svc
    # outermost: an oversized body is refused before routing, auth or parsing see it; then the turn
    # routes, served ahead of FastAPI's middleware, routing and dependency layers (hot_routes.py)
    app.front = BodyLimit(
        HotRoutes(app, app.stack),
        max_bytes=config.max_body_bytes,
        rejected=svc.metrics.rejected,
        error_body=error_body,
    )
    for router in (public, openai, anthropic, bound, sessions, admin):
        app.include_router(router)

    # Every error is answered in the envelope of the dialect of its route (`Dialect.error_body`).
    def answer(request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(error_body(request.scope, exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, GatewayError(f"invalid request: {exc.errors()}", 400))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected gateway error")
        return answer(request, internal_error(exc))

    return app
