"""The calls of every turn served without FastAPI's routing and dependency layers.

`POST /s/<id>/v1/chat/completions`, `/responses` and `/messages` are what an agent calls on every
turn; the rest of the routes are rare. FastAPI serves each call through its exception and exit-stack
middlewares, a match against every route, and the resolution of the route's dependencies and
parameters: about a third of the gateway's CPU for an unstreamed call (docs/gateway.md,
"Performance"). `HotRoutes` (an ASGI app inside the body limit, ahead of FastAPI's whole stack:
`app.GatewayApp`) matches these three paths itself and runs the same endpoint functions of `routes.py`
after the same session check, answering a `GatewayError` in the dialect's envelope as the app's
handler does, and any other error as its last handler does (a 500 in the envelope, the traceback
logged; the connection stays open, where FastAPI's error middleware raised it on to uvicorn, which
closed it). Any other request goes on to FastAPI (which still lists the routes in /openapi.json).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from palaestra.gateway import routes
from palaestra.gateway.dialect import Dialect
from palaestra.gateway.errors import GatewayError, internal_error

__all__ = ["HotRoutes"]

log = logging.getLogger("palaestra.gateway")

Endpoint = Callable[[str, Request], Awaitable[Response]]

# the session id as Starlette's `{session_id}` matches it (no slash)
_PATH = re.compile(r"/s/([^/]+)/v1/(chat/completions|responses|messages)")

_ENDPOINTS: dict[str, tuple[Endpoint, Dialect]] = {
    "chat/completions": (routes.chat_completions, routes.OPENAI_CHAT),
    "responses": (routes.responses, routes.OPENAI_RESPONSES),
    "messages": (routes.messages, routes.ANTHROPIC_MESSAGES),
}


class HotRoutes:
    """ASGI middleware: the three turn routes answered directly (module doc), the rest passed on."""

    def __init__(self, owner: Starlette, app: ASGIApp) -> None:
        self.owner = owner  # the app a request's `request.app` is (its state holds the service)
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = (
            _PATH.fullmatch(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
            else None
        )
        if m is None:
            await self.app(scope, receive, send)
            return
        session_id, (endpoint, dialect) = m.group(1), _ENDPOINTS[m.group(2)]
        scope["app"] = self.owner
        request = Request(scope, receive, send)
        try:
            await routes.require_session_access(request, session_id)
            response = await endpoint(session_id, request)
        except GatewayError as exc:  # as the app's handler answers it (app.create_app)
            error = exc
        except ClientDisconnect:  # the client left before its body came: no one to answer, no error
            return
        except Exception as exc:  # as the app's last handler answers it (logged, not raised on to
            # uvicorn, which would close the connection: the agent's next call may use it)
            log.exception("unexpected gateway error")
            error = internal_error(exc)
        else:
            await response(scope, receive, send)
            return
        await JSONResponse(dialect.error_body(error), status_code=error.status, headers=error.headers)(
            scope, receive, send
        )
