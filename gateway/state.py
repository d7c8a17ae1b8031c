"""The gateway's state: configuration, sessions, the pause gate and metrics."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from palaestra.gateway import finished as finished_turns
from palaestra.gateway.auth import mint_session_token
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.guards import CUT_REASONS, REJECT_REASONS
from palaestra.gateway.history import ParseMemo
from palaestra.gateway.options import GatewayOptions
from palaestra.gateway.parsers import PARSE_ERROR_REASONS
from palaestra.gateway.renderer import HistoryDigests
from palaestra.gateway.trajectory import FORK_REASONS, Turn


@dataclass(kw_only=True)
class GatewayConfig(GatewayOptions):
    """Options of `palaestra gateway serve`: the run-tunable `GatewayOptions` and what a deployment
    sets (model, engine URL, address, keys, spool). The command's flags are generated from these
    fields (gateway/cli.py), each docstring being the flag's help."""

    model: str
    """Preset name or HF directory: its tokenizer and chat template."""

    engine_url: str
    """sglang-router URL (or one engine's) speaking SGLang /generate."""

    host: str = "127.0.0.1"
    """Bind address."""

    port: int = 8000
    """TCP port."""

    public_url: str | None = None
    """Base URL put into session base_urls (default: as requested)."""

    api_key: str | None = None
    """The environment key (or env PALAESTRA_API_KEY): the session API, /samples, /metrics and every
    session's /s/<id>/v1 routes. Agents get their session's own token instead (docs/gateway.md)."""

    admin_key: str | None = None
    """Admin key, for /admin routes only (or env PALAESTRA_ADMIN_KEY)."""

    insecure_local: bool = False
    """Serve without keys (loopback development only)."""

    spool_dir: str = "runs/spool"
    """Directory of the durable sample spool and of the session journal."""

    spool_segment_bytes: int = 64 << 20
    """Size at which the spool starts a new segment file (acknowledged segments are deleted whole)."""

    spool_keep_acked: bool = False
    """Keep spool segments whose samples are all acknowledged (POST /samples/ack); by default they
    are deleted, which is what bounds the spool's disk use."""

    journal_segment_bytes: int = 16 << 20
    """Size at which the session journal starts a new segment (segments of finished sessions are
    deleted whole)."""

    served_model_name: str | None = None
    """Model name in answers (default: --model)."""

    retry_after_s: int = 5
    """Retry-After seconds on 429."""

    engine_incremental_stream: bool = False
    """The engines run with --incremental-streaming-output (deltas instead of cumulative)."""

    max_sessions: int = 10_000
    """Sessions kept in memory (finished ones are evicted oldest-first beyond this)."""

    def resolve_keys(self) -> None:
        self.api_key = self.api_key or os.environ.get("PALAESTRA_API_KEY") or None
        self.admin_key = self.admin_key or os.environ.get("PALAESTRA_ADMIN_KEY") or None
        if not self.insecure_local and (not self.api_key or not self.admin_key):
            missing = [
                n
                for n, v in (
                    ("--api-key / PALAESTRA_API_KEY", self.api_key),
                    ("--admin-key / PALAESTRA_ADMIN_KEY", self.admin_key),
                )
                if not v
            ]
            raise SystemExit(
                f"palaestra gateway: no {' and no '.join(missing)} given. Every route but /health needs the "
                "environment key (or, for an agent, its session's token) and admin routes the admin key. Set "
                "them, or pass --insecure-local explicitly to serve without authentication on loopback."
            )


@dataclass
class Session:
    session_id: str
    env: str
    task_id: str
    group_id: str
    metadata: dict[str, Any]
    token: str = ""
    """The session's own credential (gateway/auth.py): opens only its /s/<id>/v1 routes."""
    created: float = field(default_factory=time.time)
    turns: list[Turn] = field(default_factory=list)
    by_digest: dict[int, list[Turn]] = field(default_factory=dict)
    forks: list[dict[str, Any]] = field(default_factory=list)
    failed_calls: list[dict[str, Any]] = field(default_factory=list)
    history: HistoryDigests = field(default_factory=HistoryDigests)
    """The last call's message digests, reused by the next call on the history it repeats."""
    parse_memo: ParseMemo = field(default_factory=ParseMemo)
    """The last call's parsed history, reused by the next call's parser (gateway/history.py)."""
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Kept conversations by call id (internal messages incl. the reply): Responses `store`."""
    finished: bool = False
    status: str | None = None
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """The episode's metrics as the reward call gave them (``failure/<name>`` counts say what went wrong)."""
    sample_ids: list[str] = field(default_factory=list)
    cursors: list[int] = field(default_factory=list)
    sampled_tokens: int = 0
    finish_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    """When a call last started or ended (the idle timeout's clock; not journaled)."""
    busy: int = 0
    """Calls of this session in flight (an idle session has none)."""
    packed_turns: str | None = None
    """Set by `release`: the turns' summaries without token lists (gateway/finished.py)."""

    def release(self, leaves: list[Turn]) -> None:
        """Drops what only calls needed, once the session is finished and its samples (sample `i` is
        `leaves[i]`'s) are durable: the turns' token lists (the spool has them; `trajectory` reads
        them back), bridging's lookups, the parse memo and kept conversations."""
        self.conversations = {}
        packed = finished_turns.pack_turns(self.turns, leaves, self.parse_errors())
        if packed is None:  # not from the gateway's own bridging: keep the turns, drop their texts
            for turn in self.turns:
                turn.rendered = turn.output_text = ""
            return
        self.packed_turns = packed
        self.turns, self.by_digest = [], {}
        self.history, self.parse_memo = HistoryDigests(), ParseMemo()

    def add_turn(self, turn: Turn) -> None:
        self.turns.append(turn)
        if turn.parent is not None:
            turn.parent.children += 1
        if turn.digest is not None:
            self.by_digest.setdefault(turn.digest, []).append(turn)
        if turn.fork_reason:
            self.forks.append(
                {"turn_id": turn.turn_id, "reason": turn.fork_reason, "detail": turn.fork_detail}
            )

    def parse_errors(self) -> dict[str, int]:
        """Outputs that did not parse, counted by reason over the session's turns."""
        counts: dict[str, int] = {}
        for turn in self.turns:
            for error in (turn.parse or {}).get("errors", ()):
                counts[error["reason"]] = counts.get(error["reason"], 0) + 1
        return counts

    def leaves(self) -> list[Turn]:
        return [t for t in self.turns if t.children == 0]

    def trajectory(self, samples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What GET /sessions/{id} answers; a released session's token lists come from its `samples`
        (in `sample_ids` order; None: no longer spooled, the lists are null)."""
        if self.packed_turns is not None:
            turns, parse_errors = finished_turns.unpack_turns(self.packed_turns, samples)
        else:
            turns, parse_errors = [t.summary() for t in self.turns], self.parse_errors()
        return {
            "session_id": self.session_id,
            "env": self.env,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            "finished": self.finished,
            "status": self.status,
            "reward": self.reward,
            "metrics": self.metrics,
            "failures": sorted(
                k.removeprefix("failure/") for k, v in self.metrics.items() if k.startswith("failure/") and v
            ),
            "turns": turns,
            "forks": self.forks,
            "parse_errors": parse_errors,
            "failed_calls": self.failed_calls,
            "sample_ids": self.sample_ids,
        }


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "palaestra_gateway"
        self.calls = Counter(f"{p}_calls", "OpenAI calls answered", ["route", "status"], registry=r)
        self.turns = Counter(f"{p}_turns", "Turns recorded (one per sampled choice)", ["kind"], registry=r)
        self.forks = Counter(
            f"{p}_forks", "Turns that started a new sample, by reason", ["reason"], registry=r
        )
        for reason in FORK_REASONS:
            self.forks.labels(reason=reason)
        self.bridged = Counter(
            f"{p}_bridged_turns", "Turns built on the previous turn's exact tokens", registry=r
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens sent to engines", registry=r)
        self.completion_tokens = Counter(f"{p}_completion_tokens", "Tokens sampled", registry=r)
        self.engine_errors = Counter(f"{p}_engine_errors", "Failed engine calls", ["code"], registry=r)
        self.parse_errors = Counter(
            f"{p}_parse_errors",
            "Outputs that did not parse (returned as content), by reason",
            ["reason"],
            registry=r,
        )
        for reason in PARSE_ERROR_REASONS:
            self.parse_errors.labels(reason=reason)
        self.sessions_created = Counter(f"{p}_sessions_created", "Sessions created", registry=r)
        self.sessions_finished = Counter(
            f"{p}_sessions_finished", "Sessions finished", ["status"], registry=r
        )
        self.samples = Counter(f"{p}_samples_spooled", "Samples made durable", registry=r)
        self.active = Gauge(f"{p}_active_sessions", "Sessions not yet rewarded", registry=r)
        self.in_flight = Gauge(f"{p}_in_flight_calls", "Generation calls in flight", registry=r)
        self.paused = Gauge(f"{p}_paused", "1 while generation is paused", registry=r)
        self.auth_refused = Counter(
            f"{p}_auth_refused",
            "Calls refused for their credential, by what the route needs (admin, environment, session) "
            "and status (401 missing/unknown, 403 out of scope)",
            ["scope", "status"],
            registry=r,
        )
        self.rejected = Counter(
            f"{p}_rejected_requests",
            "Requests refused before or while parsing, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        self.streams_cut = Counter(
            f"{p}_streams_cut",
            "Streamed answers ended before their last event, by reason",
            ["reason"],
            registry=r,
        )
        for reason in CUT_REASONS:
            self.streams_cut.labels(reason=reason)
        self.overhead = Histogram(
            f"{p}_call_overhead_seconds",
            "Gateway time per call outside the engine",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )


class PauseGate:
    """Drain control: while paused, new generation calls wait (bounded) or get 429; in-flight ones finish."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics):
        self.config = config
        self.metrics = metrics
        self._open = asyncio.Event()
        self._open.set()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self._open.set()
        self.metrics.paused.set(0)

    async def drained(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def enter(self) -> None:
        if self.paused:
            if self.config.pause_mode == "reject":
                raise GatewayError(
                    "generation is paused for a weight update; retry shortly",
                    429,
                    type="rate_limit_error",
                    code="paused",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                )
            try:
                await asyncio.wait_for(self._open.wait(), self.config.pause_wait_s)
            except TimeoutError:
                raise GatewayError(
                    f"generation stayed paused for {self.config.pause_wait_s:g} s",
                    503,
                    type="server_error",
                    code="paused_too_long",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                ) from None
        self.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()


class SessionStore:
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
    ) -> Session:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise GatewayError(f"session {sid!r} already exists", 409, code="session_exists")
        session = Session(
            sid, env, task_id, group_id or f"{env}/{task_id}", metadata, token=mint_session_token(sid)
        )
        self._sessions[sid] = session
        self.metrics.sessions_created.inc()
        self.metrics.active.inc()
        self.open_count += 1
        self._evict()
        return session

    def adopt(self, session: Session) -> None:
        """A session rebuilt from the journal at start (gateway/journal.py)."""
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


def spool_path(config: GatewayConfig) -> Path:
    return Path(config.spool_dir)
