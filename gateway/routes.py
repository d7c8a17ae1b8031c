"""HTTP routes: OpenAI-compatible calls under a session prefix, the session API, samples, admin.

Each generation route binds its path to a dialect (`dialect.Dialect`: the request parser and the
answer shapers) and hands the body to `GatewayService`, which is the same for every dialect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.routing import Match
from starlette.types import Scope as AsgiScope

from palaestra.gateway.auth import Scope, authorize
from palaestra.gateway.dialect import Dialect, TextRequest, TurnRequest
from palaestra.gateway.dialects import (
    anthropic_api,
    openai_request,
    openai_response,
    responses_answer,
    responses_api,
)
from palaestra.gateway.dialects import openapi_schemas as schemas
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.guards import GuardedStream, count_rejection, read_json
from palaestra.gateway.service import GatewayService
from palaestra.gateway.sessions import as_text
from palaestra.gateway.sessions import sampling as session_sampling
from palaestra.sample import STATUSES


class FastJSON(JSONResponse):
    """JSON answers serialised by orjson (the stdlib encoder is a measurable part of a call)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def service(request: Request) -> GatewayService:
    return request.app.state.service


# The dependencies are coroutines on purpose: FastAPI runs a plain `def` dependency in its thread
# pool, a thread hand-off per request that cost more than the rest of the routing (bench/gateway.py).
# Which credential opens which route: gateway/auth.py.
def _authorize(request: Request, scope: Scope, session_id: str | None = None) -> None:
    """`authorize`, counting refusals in /metrics by what the route needed and the status."""
    svc = service(request)
    try:
        authorize(request, svc.config, svc.sessions, scope, session_id)
    except GatewayError as exc:
        svc.metrics.auth_refused.labels(scope=scope.value, status=str(exc.status)).inc()
        raise


async def require_api_key(request: Request) -> None:
    """The environment key (the run's `--api-key`)."""
    _authorize(request, Scope.ENVIRONMENT)


async def require_admin_key(request: Request) -> None:
    _authorize(request, Scope.ADMIN)


async def require_session_access(request: Request, session_id: str) -> None:
    """This session's token, or the environment key."""
    _authorize(request, Scope.SESSION, session_id)


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object (`guards.read_json`: bad UTF-8, bad JSON, too deep: a counted 400)."""
    return read_json(await request.body(), service(request).metrics.rejected)


async def turn_body(request: Request, session_id: str, route: str, key: str) -> dict[str, Any]:
    """`json_body` of a turn route's call (`route`, its history in the field `key`): an open
    session's bodies are parsed from the bytes the last one did not have (`ParseMemo.read_body`)."""
    svc = service(request)
    raw = await request.body()
    session = svc.sessions.get(session_id) if session_id in svc.sessions else None
    if session is None or session.finished:  # refused later, as without the memo
        return read_json(raw, svc.metrics.rejected)
    return session.parse_memo.read_body(raw, route, key, svc.metrics.rejected)


def event_stream(request: Request, events: Any) -> GuardedStream:
    """A streamed answer that a client who stops reading cannot hold open (`guards.GuardedStream`)."""
    svc = service(request)
    return GuardedStream(events, send_timeout_s=svc.config.stream_send_timeout_s, cut=svc.metrics.streams_cut)


openai = APIRouter(prefix="/s/{session_id}/v1", dependencies=[Depends(require_session_access)])

OPENAI_CHAT: Dialect[TurnRequest] = Dialect(
    "chatcmpl-",
    openai_request.parse_chat,
    openai_response.chat_completion,
    openai_response.chat_stream,
    takes_memo=True,
    name="chat",
)
OPENAI_COMPLETIONS: Dialect[TextRequest] = Dialect(
    "cmpl-",
    openai_request.parse_completion,
    openai_response.text_completion,
    history_field="prompt",
    name="completions",
)
OPENAI_RESPONSES: Dialect[TurnRequest] = Dialect(
    "resp_",
    responses_api.parse,
    responses_answer.answer,
    responses_answer.stream,
    takes_memo=True,
    history_field="input",
    name="responses",
)
ANTHROPIC_MESSAGES: Dialect[TurnRequest] = Dialect(
    "msg_",
    anthropic_api.parse,
    anthropic_api.answer,
    anthropic_api.stream,
    takes_memo=True,
    error_body=anthropic_api.error_body,
    name="messages",
    headers=(anthropic_api.BETA_HEADER,),
)

_DIALECT_OF: dict[Callable[..., Any], Dialect] = {}  # endpoint -> the dialect it speaks (`_speaks`)


def _speaks(dialect: Dialect) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Binds an endpoint to `dialect`: its errors are answered in the dialect's envelope."""

    def bind(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        _DIALECT_OF[endpoint] = dialect
        return endpoint

    return bind


async def _counted(
    request: Request, route: str, call, history_field: str = "messages", session_id: str | None = None
) -> Any:
    """Reads the JSON body and runs a service call on it, counting it by route and status in /metrics.
    Errors about the rendered conversation (param 'messages') name the dialect's `history_field`.
    With `session_id`, a turn's call: its body read by `turn_body`."""
    svc = service(request)
    try:
        body = await (
            json_body(request) if session_id is None else turn_body(request, session_id, route, history_field)
        )
        result = await call(svc, body)
    except GatewayError as exc:
        if exc.param == "messages":
            exc.param = history_field
        svc.metrics.calls.labels(route=route, status=str(exc.status)).inc()
        count_rejection(svc.metrics.rejected, exc)
        raise
    svc.metrics.call_child(route, "200").inc()
    return result


async def _answer(
    request: Request, route: str, call, history_field: str = "messages", session_id: str | None = None
) -> Response:
    """`_counted`, answered as JSON or, for a stream, as server-sent events."""
    result = await _counted(request, route, call, history_field, session_id)
    if isinstance(result, dict):
        return FastJSON(result)
    return event_stream(request, result)


@openai.post("/chat/completions", openapi_extra=schemas.body(schemas.CHAT))
@_speaks(OPENAI_CHAT)
async def chat_completions(session_id: str, request: Request) -> Response:
    return await _answer(
        request, "chat", lambda svc, body: svc.chat(session_id, body, OPENAI_CHAT), session_id=session_id
    )


@openai.post("/responses", openapi_extra=schemas.body(schemas.RESPONSES))
@_speaks(OPENAI_RESPONSES)
async def responses(session_id: str, request: Request) -> Response:
    return await _answer(
        request,
        "responses",
        lambda svc, body: svc.chat(session_id, body, OPENAI_RESPONSES),
        OPENAI_RESPONSES.history_field,
        session_id,
    )


@openai.post("/completions", openapi_extra=schemas.body(schemas.COMPLETIONS))
@_speaks(OPENAI_COMPLETIONS)
async def completions(session_id: str, request: Request) -> Response:
    return FastJSON(
        await _counted(
            request,
            "completions",
            lambda svc, body: svc.completion(session_id, body, OPENAI_COMPLETIONS),
            OPENAI_COMPLETIONS.history_field,
        )
    )


@openai.get("/models")
async def models(session_id: str, request: Request) -> dict[str, Any]:
    svc = service(request)
    svc.sessions.get(session_id)
    return {
        "object": "list",
        "data": [
            {
                "id": svc.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "palaestra",
                "max_model_len": svc.context_length,
            }
        ],
    }


# Anthropic clients send the key as `x-api-key`, which `authorize` accepts as it does a bearer token;
# their errors (auth included) take Anthropic's envelope through `ANTHROPIC_MESSAGES.error_body`.
anthropic = APIRouter(prefix="/s/{session_id}/v1", dependencies=[Depends(require_session_access)])


@anthropic.post("/messages", openapi_extra=schemas.body(schemas.ANTHROPIC_MESSAGES))
@_speaks(ANTHROPIC_MESSAGES)
async def messages(session_id: str, request: Request) -> Response:
    headers = {name: request.headers.get(name, "") for name in ANTHROPIC_MESSAGES.headers}
    return await _answer(
        request,
        "messages",
        lambda svc, body: svc.chat(session_id, body, ANTHROPIC_MESSAGES, headers),
        session_id=session_id,
    )


@anthropic.post("/messages/count_tokens", openapi_extra=schemas.body(schemas.ANTHROPIC_COUNT))
@_speaks(ANTHROPIC_MESSAGES)
async def count_tokens(session_id: str, request: Request) -> Response:
    async def count(svc: GatewayService, body: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": svc.count_tokens(session_id, body, anthropic_api.parse_count)}

    return await _answer(request, "count_tokens", count)


DIALECT_ROUTERS: list[APIRouter] = [openai, anthropic]
"""The routers whose routes speak a dialect (`error_body` looks a route up in them);
gateway/header_sessions.py adds its own."""


def error_body(scope: AsgiScope, exc: GatewayError) -> dict[str, Any]:
    """`exc` in the error envelope of the dialect of the route `scope` asks for (OpenAI's for a
    route of no dialect). The route is matched as the router matches it, so this answers the same
    before routing (the body limit) as after."""
    for route in (route for router in DIALECT_ROUTERS for route in router.routes):
        dialect = _DIALECT_OF.get(getattr(route, "endpoint", None))
        if dialect is not None and route.matches(scope)[0] is Match.FULL:
            return dialect.error_body(exc)
    return exc.body()


sessions = APIRouter(dependencies=[Depends(require_api_key)])


@sessions.post("/sessions", openapi_extra=schemas.body(schemas.SESSION, required=False))
async def create_session(request: Request) -> dict[str, Any]:
    svc = service(request)
    body = await json_body(request)
    env, task_id = body.get("env", "default"), body.get("task_id", "")
    group_id, metadata = body.get("group_id"), body.get("metadata") or {}
    session_id = body.get("session_id")
    for name, value in (("env", env), ("task_id", task_id)):
        if not isinstance(value, str):
            raise GatewayError(f"'{name}' must be a string", param=name)
    if group_id is not None and not isinstance(group_id, str):
        raise GatewayError("'group_id' must be a string", param="group_id")
    if session_id is not None and (
        not isinstance(session_id, str) or not session_id.replace("-", "").isalnum()
    ):
        raise GatewayError("'session_id' must be letters, digits and dashes", param="session_id")
    if not isinstance(metadata, dict):
        raise GatewayError("'metadata' must be an object", param="metadata")
    sampling = session_sampling.parse(body.get("sampling"))
    session = svc.create_session(env, task_id, group_id, metadata, session_id, sampling)
    base = (svc.config.public_url or str(request.base_url)).rstrip("/")
    return {
        "session_id": session.session_id,
        "group_id": session.group_id,
        "base_url": f"{base}/s/{session.session_id}/v1",
        "api_key": session.token,  # opens only this session's /s/{id}/v1 routes (gateway/auth.py)
    }


@sessions.post("/sessions/{session_id}/reward", openapi_extra=schemas.body(schemas.REWARD))
async def reward(session_id: str, request: Request) -> dict[str, Any]:
    svc = service(request)
    body = await json_body(request)
    value = body.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GatewayError("'reward' must be a number", param="reward")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values()
    ):
        raise GatewayError("'metrics' must be an object of numbers", param="metrics")
    status = body.get("status", "completed")
    if status not in STATUSES:
        raise GatewayError(f"'status' must be one of {', '.join(STATUSES)}", param="status")
    if body.get("done", True) is not True:
        raise GatewayError("only final rewards are supported ('done': true)", param="done")
    metrics = {k: float(v) for k, v in metrics.items()}
    answer = await svc.finish(session_id, float(value), metrics, status)
    session = svc.sessions.get(session_id)
    if not session.metrics:  # the first reward call's, like the rest of a finished session
        session.metrics = metrics
    return answer


@sessions.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request, text: bool = False) -> dict[str, Any]:
    """The session's trajectory; `?text=true` adds each turn's context and reply as text
    (gateway/sessions/as_text.py: `palaestra session show`)."""
    svc = service(request)
    trajectory = await svc.trajectory(session_id)
    if not text:
        return trajectory
    tokenizer = svc.renderer.tokenizer
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return await asyncio.to_thread(as_text.with_text, trajectory, decode)


@sessions.get("/samples")
async def samples(request: Request, after: int = 0, limit: int = 100) -> dict[str, Any]:
    svc = service(request)
    records = await asyncio.to_thread(svc.spool.read, after, max(1, min(limit, 1000)))
    return {
        "samples": [r["sample"] for r in records],
        "cursors": [r["cursor"] for r in records],
        "cursor": records[-1]["cursor"] if records else max(after, svc.spool.first_cursor - 1),
        "last_cursor": svc.spool.last_cursor,
        "first_cursor": svc.spool.first_cursor,
    }


@sessions.post("/samples/ack")
async def samples_ack(request: Request) -> dict[str, Any]:
    """The consumer has everything up to `cursor` for good (the trainer: a checkpoint records it);
    spool segments holding only acknowledged samples are deleted (unless --spool-keep-acked)."""
    svc = service(request)
    cursor = (await json_body(request)).get("cursor")
    if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
        raise GatewayError("'cursor' must be a non-negative integer", param="cursor")
    try:
        deleted = await asyncio.to_thread(svc.spool.ack, cursor)
    except ValueError as exc:
        raise GatewayError(str(exc), param="cursor") from None
    return {
        "acked": svc.spool.acked,
        "segments_deleted": deleted,
        "first_cursor": svc.spool.first_cursor,
        "last_cursor": svc.spool.last_cursor,
    }


@sessions.get("/samples/stream")
async def samples_stream(request: Request, after: int = 0, heartbeat_s: float = 15.0) -> StreamingResponse:
    """Server-sent events: every sample after `after`, then new ones as they become durable."""
    svc = service(request)

    async def events():
        cursor = after
        while not await request.is_disconnected():
            records = await asyncio.to_thread(svc.spool.read, cursor, 500)
            for r in records:
                yield f"id: {r['cursor']}\ndata: {json.dumps(r['sample'])}\n\n"
                cursor = r["cursor"]
            if not records and not await svc.spool.wait_for(cursor, heartbeat_s):
                yield ": heartbeat\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin_key)])


@admin.post("/pause")
async def pause(request: Request, wait: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
    """New generation calls wait (or get 429); with ?wait=true, returns once in-flight calls finished."""
    svc = service(request)
    svc.gate.pause()
    drained = await svc.gate.drained(timeout_s) if wait else svc.gate.in_flight == 0
    return {"paused": True, "in_flight": svc.gate.in_flight, "drained": drained}


@admin.get("/routing")
async def routing(request: Request) -> dict[str, Any]:
    """Per-environment engine traffic and, with placement on, each worker's sessions, load and
    cache hits, and the moves made (docs/routing.md)."""
    return service(request).routing.snapshot()


@admin.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    svc = service(request)
    svc.gate.resume()
    return {"paused": False, "in_flight": svc.gate.in_flight}


public = APIRouter()


@public.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@public.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(service(request).metrics.registry), media_type="text/plain; version=0.0.4"
    )
