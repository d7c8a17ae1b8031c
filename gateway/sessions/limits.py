"""What a run's gateway may hold, each bounded by an option with back-pressure when reached.

* open sessions (`max_open_sessions`): `POST /sessions` beyond it gets 429 + Retry-After;
* the spool directory's disk use, samples + session journal (`spool_max_bytes`): 429 on
  `POST /sessions` until the consumer acknowledges samples (`POST /samples/ack`) and the spool
  deletes them. Sessions already open still finish: what they add is bounded by the open sessions;
* the stream's backlog, samples durable but neither delivered to a reader of `/samples` nor
  acknowledged (`max_backlog_samples`): 429 on `POST /sessions` (the trainer is behind);
* abandoned sessions: a session with no call in flight and none for `session_idle_timeout_s` is
  finished as `aborted` with metric `failure/idle_timeout` (`IdleReaper`), so its slot and its
  journal segments are freed and its tokens still reach the trainer's accounting.

Every refusal names the limit and its option, and is counted in
`palaestra_gateway_sessions_refused_total{limit}`; the levels are gauges (docs/reliability-journal.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.sessions.journal import SessionJournal
from palaestra.gateway.sessions.session_store import SessionStore
from palaestra.gateway.sessions.spool import SampleSpool

__all__ = ["LIMITS", "IdleReaper", "Limits"]

log = logging.getLogger("palaestra.gateway.sessions.limits")

LIMITS = ("open_sessions", "spool_bytes", "backlog")


class Limits:
    """Admission of new sessions against the configured bounds, and their gauges."""

    def __init__(
        self,
        config: GatewayConfig,
        sessions: SessionStore,
        spool: SampleSpool,
        journal: SessionJournal,
        registry: CollectorRegistry,
    ):
        self.config, self.sessions, self.spool, self.journal = config, sessions, spool, journal
        p = "palaestra_gateway"
        self.refused = Counter(
            f"{p}_sessions_refused", "POST /sessions refused by a limit", ["limit"], registry=registry
        )
        for name in LIMITS:
            self.refused.labels(limit=name)
        self.idle_timeouts = Counter(
            f"{p}_sessions_idle_timeout",
            "Sessions finished as aborted after session_idle_timeout_s",
            registry=registry,
        )
        limit = Gauge(f"{p}_limit", "Configured limits", ["name"], registry=registry)
        limit.labels(name="max_open_sessions").set(config.max_open_sessions)
        limit.labels(name="spool_max_bytes").set(config.spool_max_bytes)
        limit.labels(name="max_backlog_samples").set(config.max_backlog_samples)
        limit.labels(name="session_idle_timeout_s").set(config.session_idle_timeout_s)
        gauges: dict[str, tuple[str, Callable[[], float]]] = {
            "open_sessions": ("Sessions not yet finished", lambda: self.sessions.open_count),
            "spool_bytes": ("Bytes of sample segments on disk", lambda: self.spool.bytes),
            "journal_bytes": ("Bytes of session journal segments on disk", lambda: self.journal.bytes),
            "spool_backlog_samples": ("Durable samples not yet delivered or acknowledged", self._backlog),
            "spool_last_cursor": ("The last durable sample cursor", lambda: self.spool.last_cursor),
            "spool_acked_cursor": ("The cursor acknowledged by the consumer", lambda: self.spool.acked),
            "spool_segments_deleted": (
                "Acknowledged spool segments deleted by this process",
                lambda: self.spool.segments_deleted,
            ),
            "journal_segments_deleted": (
                "Journal segments of finished sessions deleted by this process",
                lambda: self.journal.segments_deleted,
            ),
            "journal_fsyncs": ("fsync calls on the session journal", lambda: self.journal.fsyncs),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(f"{p}_{name}", doc, registry=registry).set_function(fn)
        records = Gauge(
            f"{p}_journal_records", "Journal records written by this process", ["kind"], registry=registry
        )
        for kind in self.journal.records:
            records.labels(kind=kind).set_function(lambda kind=kind: self.journal.records[kind])

    def _backlog(self) -> float:
        return self.spool.backlog

    def disk_bytes(self) -> int:
        return self.spool.bytes + self.journal.bytes

    def admit(self) -> None:
        """Raises 429 (Retry-After) when a new session would pass a limit."""
        c = self.config
        if self.sessions.open_count >= c.max_open_sessions:
            self._refuse(
                "open_sessions",
                f"{self.sessions.open_count} sessions are open, the limit (--max-open-sessions / "
                f"gateway.max_open_sessions) is {c.max_open_sessions}; finish some (POST /sessions/{{id}}/reward) "
                "or retry later",
            )
        used = self.disk_bytes()
        if used >= c.spool_max_bytes:
            self._refuse(
                "spool_bytes",
                f"the spool directory holds {used} bytes, the limit (--spool-max-bytes / gateway.spool_max_bytes) "
                f"is {c.spool_max_bytes}; the consumer must acknowledge samples (POST /samples/ack) so that "
                "they can be deleted",
            )
        backlog = self.spool.backlog
        if backlog >= c.max_backlog_samples:
            self._refuse(
                "backlog",
                f"{backlog} durable samples wait for the consumer, the limit (--max-backlog-samples / "
                f"gateway.max_backlog_samples) is {c.max_backlog_samples}; retry when the trainer has read them",
            )

    def _refuse(self, limit: str, message: str) -> None:
        self.refused.labels(limit=limit).inc()
        raise GatewayError(
            message,
            429,
            type="rate_limit_error",
            code=f"limit_{limit}",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )


class IdleReaper:
    """Finishes sessions idle for `session_idle_timeout_s` as aborted (`failure/idle_timeout`)."""

    def __init__(
        self,
        limits: Limits,
        finish: Callable[[str, float, dict[str, float], str], Awaitable[Any]],
    ):
        self.limits = limits
        self.finish = finish

    def idle(self, now: float) -> list[str]:
        timeout = self.limits.config.session_idle_timeout_s
        return [
            s.session_id
            for s in self.limits.sessions.open_sessions()
            if s.busy == 0 and now - s.last_active >= timeout
        ]

    async def reap(self) -> int:
        """Finishes every idle session now; returns how many."""
        n = 0
        for sid in self.idle(time.monotonic()):
            session = self.limits.sessions.get(sid)
            if session.finished or session.busy:  # rewarded or called while an earlier one was reaped
                continue
            metrics = {"failure/idle_timeout": 1.0}
            await self.finish(sid, 0.0, metrics, "aborted")
            if not session.metrics:
                session.metrics = metrics
            self.limits.idle_timeouts.inc()
            n += 1
        if n:
            log.warning("finished %d idle session(s) as aborted (idle_timeout)", n)
        return n

    async def run(self) -> None:
        """Checks a few times per timeout (at least every minute, at most every 50 ms)."""
        timeout = self.limits.config.session_idle_timeout_s
        if timeout <= 0:
            return
        period = min(max(timeout / 4, 0.05), 60.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap()
            except Exception:  # a failed finish (disk) must not stop the reaper
                log.exception("idle session reaper")
