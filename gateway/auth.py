"""Who may call what: the gateway's three credentials and the routes each one opens.

- the **admin key** (`--admin-key` / ``PALAESTRA_ADMIN_KEY``) opens ``/admin/*`` (pause, resume)
  and nothing else: the run driver, which holds it, holds the environment key too;
- the **environment key** (`--api-key` / ``PALAESTRA_API_KEY``) opens the session API
  (``POST /sessions``, ``GET /sessions/{id}``, ``POST /sessions/{id}/reward``), ``/samples``,
  ``/samples/stream``, ``/metrics``, and every session's ``/s/{id}/v1/...`` routes (an environment
  owns the sessions it creates);
- a **session token**, minted by ``POST /sessions`` and returned there as ``api_key``, opens only
  its own session's ``/s/{id}/v1/...`` routes. It is what the agent being trained holds, so an agent
  can neither read nor write another session, nor post its own reward, nor reach admin routes.

Every credential is sent as ``Authorization: Bearer <key>`` (what the ``openai`` SDK sends) or as
``x-api-key`` (what the ``anthropic`` SDK sends). A route whose key is not configured
(``--insecure-local``) checks nothing. A key nobody issued is a 401; a real credential used
outside its scope is a 403 that says what it opens and what the route needs.

A session token is ``pst_<session id>.<secret>``: the session id in it lets a refusal say whose
token it is without a second index of tokens, and the secret (32 random bytes) is compared in
constant time with the one stored on the session.
"""

from __future__ import annotations

import hmac
import secrets
from enum import Enum
from typing import TYPE_CHECKING

from fastapi import Request

from palaestra.gateway.errors import GatewayError

if TYPE_CHECKING:
    from palaestra.gateway.config import GatewayConfig
    from palaestra.gateway.sessions.session_store import SessionStore

__all__ = ["SESSION_TOKEN_PREFIX", "Scope", "authorize", "mint_session_token", "presented_key"]

SESSION_TOKEN_PREFIX = "pst_"


class Scope(Enum):
    """What a route needs."""

    ADMIN = "admin"
    """The admin key."""
    ENVIRONMENT = "environment"
    """The environment key."""
    SESSION = "session"
    """The route's own session token, or the environment key."""


def mint_session_token(session_id: str) -> str:
    """A new token for `session_id` (session ids are letters, digits and dashes: no '.')."""
    return f"{SESSION_TOKEN_PREFIX}{session_id}.{secrets.token_urlsafe(32)}"


def _token_session(token: str) -> str | None:
    """The session a token names, or None if it is not shaped like a session token."""
    if not token.startswith(SESSION_TOKEN_PREFIX) or "." not in token:
        return None
    return token[len(SESSION_TOKEN_PREFIX) :].rpartition(".")[0] or None


def presented_key(request: Request) -> str | None:
    """The credential a request carries: a bearer token, else ``x-api-key`` (each header's first
    value). Read from the raw header list in one pass, as every call does: ASGI names are lower-case."""
    auth = api_key = None
    for name, value in request.scope["headers"]:
        if name == b"authorization":
            if auth is None:
                auth = value
        elif name == b"x-api-key" and api_key is None:
            api_key = value
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip()
    return api_key.decode("latin-1") if api_key is not None else None


def _same(got: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(got.encode(), expected.encode())


def _valid_session_token(got: str, sessions: SessionStore) -> str | None:
    """The id of the live session whose token `got` is, else None."""
    sid = _token_session(got)
    if sid is None:
        return None
    try:
        session = sessions.get(sid)
    except GatewayError:  # unknown or evicted: the token opens nothing
        return None
    return sid if _same(got, session.token or None) else None


def _route(request: Request) -> str:
    """The refused call, for messages."""
    return f"{request.method} {request.scope['path']}"


def _needs(scope: Scope, session_id: str | None) -> str:
    if scope is Scope.ADMIN:
        return "the admin key (--admin-key / PALAESTRA_ADMIN_KEY)"
    if scope is Scope.ENVIRONMENT:
        return "the environment key (--api-key / PALAESTRA_API_KEY)"
    return (
        f"session {session_id!r}'s token (the api_key of its POST /sessions answer) "
        "or the environment key (--api-key / PALAESTRA_API_KEY)"
    )


def authorize(
    request: Request,
    config: GatewayConfig,
    sessions: SessionStore,
    scope: Scope,
    session_id: str | None = None,
) -> None:
    """Returns if the request's credential opens `scope` (for SESSION: session `session_id`);
    raises a 401 GatewayError for a missing or unknown key and a 403 for a real one out of scope."""
    expected = config.admin_key if scope is Scope.ADMIN else config.api_key
    if expected is None:  # --insecure-local: nothing is checked
        return
    got = presented_key(request)
    if not got:
        raise GatewayError(
            f"Missing key: {_route(request)} needs {_needs(scope, session_id)}. Send it as "
            "'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
            401,
            type="invalid_request_error",
            code="invalid_api_key",
        )
    if _same(got, expected):
        return
    owner = _valid_session_token(got, sessions)
    if scope is Scope.SESSION and owner == session_id:
        return
    if owner is not None:
        held = f"a session token opens only its own session's routes (/s/{owner}/v1/...)"
    elif _same(got, config.admin_key):
        held = "the admin key opens only /admin/* routes"
    elif _same(got, config.api_key):
        held = "the environment key does not open /admin/* routes"
    else:
        raise GatewayError(
            f"Incorrect key: {_route(request)} needs {_needs(scope, session_id)}.",
            401,
            type="invalid_request_error",
            code="invalid_api_key",
        )
    raise GatewayError(
        f"Not allowed: {held}; {_route(request)} needs {_needs(scope, session_id)}.",
        403,
        type="permission_error",
        code="wrong_credential",
    )
