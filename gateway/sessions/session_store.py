"""`SessionStore`: the gateway's sessions by id — created (each with its own token), adopted from
the journal at start, counted while open (the `max_open_sessions` limit), and the finished ones
evicted oldest-first beyond `max_sessions`."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from palaestra.gateway.auth import mint_session_token
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.sessions.session import Session

if TYPE_CHECKING:
    from palaestra.gateway.metrics import GatewayMetrics

__all__ = ["SessionStore"]


class SessionStore:
    """Sessions by id, in creation order (module docstring)."""

    def __init__(self, max_sessions: int, metrics: GatewayMetrics):
        self.max_sessions = max_sessions
        self.metrics = metrics
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.open_count = 0  # sessions not finished (the max_open_sessions limit)

    def create(
        self,
        env: str,
        task_id: str,
        group_id: str | None,
        metadata: dict[str, Any],
        session_id: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Session:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise GatewayError(f"session {sid!r} already exists", 409, code="session_exists")
        session = Session(
            sid,
            env,
            task_id,
            group_id or f"{env}/{task_id}",
            metadata,
            token=mint_session_token(sid),
            sampling=dict(sampling or {}),
        )
        self._sessions[sid] = session
        self.metrics.sessions_created.inc()
        self.metrics.active.inc()
        self.open_count += 1
        self._evict()
        return session

    def adopt(self, session: Session) -> None:
        """A session rebuilt from the journal at start (gateway/sessions/journal.py)."""
        self._sessions[session.session_id] = session
        if not session.finished:
            self.metrics.active.inc()
            self.open_count += 1
        self._evict()

    def closed(self, session: Session) -> None:
        """`session` just finished."""
        self.metrics.active.dec()
        self.open_count -= 1

    def open_sessions(self) -> list[Session]:
        return [s for s in self._sessions.values() if not s.finished]

    def _evict(self) -> None:
        while len(self._sessions) > self.max_sessions:
            victim = next((k for k, s in self._sessions.items() if s.finished), None)
            if victim is None:
                return
            del self._sessions[victim]

    def __contains__(self, session_id: object) -> bool:
        """Whether a session of this id is held (open, or finished and not yet evicted)."""
        return session_id in self._sessions

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise GatewayError(
                f"unknown session {session_id!r}; create one with POST /sessions",
                404,
                code="session_not_found",
            )
        return session

    def open(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.finished:
            raise GatewayError(f"session {session_id!r} is already finished", 409, code="session_finished")
        return session
