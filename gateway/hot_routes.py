"""The calls of every turn served without FastAPI's routing and dependency layers.

`POST /s/<id>/v1/chat/completions`, `/responses` and `/messages` are what an agent calls on every
turn; the rest of the routes are rare. FastAPI serves each call through its exception and exit-stack
middlewares, a match against every route, and the resolution of the route's dependencies and
parameters: about a third of the gateway's CPU for an unstreamed call (docs/gateway.md,
"Performance"). `HotRoutes` (an ASGI middleware inside the body limit) matches these three paths
itself and runs the same endpoint functions of `routes.py` after the same session check, answering a
`GatewayError` in the dialect's envelope as the app's handler does; any other request, and any other
error, goes on to FastAPI (which still lists the routes in /openapi.json).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from palaestra.gateway import routes
from palaestra.gateway.dialect import Dialect
from palaestra.gateway.errors import GatewayError

__all__ = ["HotRoutes"]

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

    def __init__(self, app: ASGIApp) -> None:
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
        request = Request(scope, receive, send)
        try:
            await routes.require_session_access(request, session_id)
            response = await endpoint(session_id, request)
        except GatewayError as exc:  # as the app's handler answers it (app.create_app)
            response = JSONResponse(dialect.error_body(exc), status_code=exc.status, headers=exc.headers)
        await response(scope, receive, send)
