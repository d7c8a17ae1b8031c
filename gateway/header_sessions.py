"""The agent routes without a session in the path: ``/v1/...``, each request bound to a session by
its ``X-Session-ID`` header.

Clients that keep one base URL for every rollout and tag each rollout's requests with a header
(verifiers' eval client sends its rollout's trace id as ``X-Session-ID`` on every turn) reach the
gateway at ``<gateway>/v1`` instead of a session's ``/s/{id}/v1``. The header names the session:

- a session that exists is used as if its id were in the path (its token or the environment key
  opens it, as on ``/s/{id}/v1``);
- a session never seen is created on first sight, which only the environment key may do (an agent's
  session token cannot open new sessions), under the environment name, task id and group of the
  optional headers ``X-Palaestra-Env`` (default ``default``), ``X-Palaestra-Task-ID`` and
  ``X-Palaestra-Group-ID``, with metadata ``{"bound_by": "X-Session-ID"}``. It is journaled and
  scoped like one made by ``POST /sessions``, so ``GET /sessions/{id}`` and
  ``POST /sessions/{id}/reward`` take the header's value as the session id.

A request without the header is a 400 naming it and the alternative (``/s/{id}/v1`` with a session
from ``POST /sessions``); a value that is not letters, digits and dashes (what session ids are) is a
400 saying so.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from palaestra.gateway import routes
from palaestra.gateway.auth import Scope
from palaestra.gateway.dialects import openapi_schemas as schemas
from palaestra.gateway.errors import GatewayError

__all__ = ["ENV_HEADER", "GROUP_HEADER", "SESSION_HEADER", "TASK_HEADER", "bound", "bound_session"]

SESSION_HEADER = "X-Session-ID"
ENV_HEADER = "X-Palaestra-Env"
TASK_HEADER = "X-Palaestra-Task-ID"
GROUP_HEADER = "X-Palaestra-Group-ID"
MAX_ID_CHARS = 128


def bound_session(request: Request) -> str:
    """The session `request`'s ``X-Session-ID`` names, authorized, and created on first sight
    (module docstring)."""
    sid = request.headers.get(SESSION_HEADER, "").strip()
    if not sid:
        raise GatewayError(
            f"this route binds each request to a session by its {SESSION_HEADER} header, and the "
            f"request has none: send {SESSION_HEADER}: <your rollout's id>, or call "
            "/s/{session_id}/v1/... with a session from POST /sessions",
            param=SESSION_HEADER,
        )
    if len(sid) > MAX_ID_CHARS or not sid.replace("-", "").isalnum() or not sid.isascii():
        raise GatewayError(
            f"{SESSION_HEADER} must be 1-{MAX_ID_CHARS} ASCII letters, digits and dashes (a session id); "
            f"got {sid[:40]!r}",
            param=SESSION_HEADER,
        )
    svc = routes.service(request)
    if sid in svc.sessions:
        routes._authorize(request, Scope.SESSION, sid)
        return sid
    routes._authorize(request, Scope.ENVIRONMENT)  # only the environment key opens sessions
    env = request.headers.get(ENV_HEADER, "default")
    task_id = request.headers.get(TASK_HEADER, "")
    group_id = request.headers.get(GROUP_HEADER) or None
    svc.create_session(env, task_id, group_id, {"bound_by": SESSION_HEADER}, sid)
    return sid


bound = APIRouter(prefix="/v1")
routes.DIALECT_ROUTERS.append(bound)  # errors in each route's dialect's envelope, as on /s/{id}/v1


@bound.post("/chat/completions", openapi_extra=schemas.body(schemas.CHAT))
@routes._speaks(routes.OPENAI_CHAT)
async def chat_completions(request: Request) -> Response:
    return await routes.chat_completions(bound_session(request), request)


@bound.post("/responses", openapi_extra=schemas.body(schemas.RESPONSES))
@routes._speaks(routes.OPENAI_RESPONSES)
async def responses(request: Request) -> Response:
    return await routes.responses(bound_session(request), request)


@bound.post("/completions", openapi_extra=schemas.body(schemas.COMPLETIONS))
@routes._speaks(routes.OPENAI_COMPLETIONS)
async def completions(request: Request) -> Response:
    return await routes.completions(bound_session(request), request)


@bound.post("/messages", openapi_extra=schemas.body(schemas.ANTHROPIC_MESSAGES))
@routes._speaks(routes.ANTHROPIC_MESSAGES)
async def messages(request: Request) -> Response:
    return await routes.messages(bound_session(request), request)


@bound.get("/models")
async def models(request: Request) -> dict[str, Any]:
    return await routes.models(bound_session(request), request)
