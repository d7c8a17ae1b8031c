"""`Session`: one episode as the gateway holds it — its turns (the trajectory tree), forks, failed
calls, what the next call reuses (history digests, the parse memo, kept conversations) and, once
rewarded, its reward, metrics and sample ids. `release` drops the heavy part when it finishes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from palaestra.gateway.renderer import HistoryDigests
from palaestra.gateway.sessions import finished as finished_turns
from palaestra.gateway.sessions.history import ParseMemo
from palaestra.gateway.sessions.trajectory import Turn

__all__ = ["Session", "count_ignored"]


def count_ignored(turns: list[Turn]) -> dict[str, int]:
    """Recorded controls over `turns`, each call counted once (its first choice's turn)."""
    counts: dict[str, int] = {}
    for turn in turns:
        if turn.choice == 0 and turn.controls:
            for name in turn.controls.get("ignored", ()):
                counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class Session:
    """One episode's record (module docstring); `trajectory()` is what GET /sessions/{id} answers."""

    session_id: str
    env: str
    task_id: str
    group_id: str
    metadata: dict[str, Any]
    token: str = ""
    """The session's own credential (gateway/auth.py): opens only its /s/<id>/v1 routes."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """The run's sampling, applied to every call (gateway/sessions/sampling.py); {}: the calls'."""
    sampling_warned: bool = field(default=False, init=False)
    """A contradicting call was logged (once per session; not journaled)."""
    created: float = field(default_factory=time.time)
    turns: list[Turn] = field(default_factory=list)
    by_digest: dict[int, list[Turn]] = field(default_factory=dict)
    forks: list[dict[str, Any]] = field(default_factory=list)
    failed_calls: list[dict[str, Any]] = field(default_factory=list)
    refused: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Calls refused with a 400 before generating, by `route:field` (`note_refusal`): count and the
    last message. Kept in memory only (not journaled): a restarted gateway counts afresh."""
    history: HistoryDigests = field(default_factory=HistoryDigests)
    """The last call's message digests, reused by the next call on the history it repeats."""
    parse_memo: ParseMemo = field(default_factory=ParseMemo)
    """The last call's parsed history, reused by the next call's parser (gateway/sessions/history.py)."""
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
    """Set by `release`: the turns' summaries without token lists (gateway/sessions/finished.py)."""

    def release(self, leaves: list[Turn]) -> None:
        """Drops what only calls needed, once the session is finished and its samples (sample `i` is
        `leaves[i]`'s) are durable: the turns' token lists (the spool has them; `trajectory` reads
        them back), bridging's lookups, the parse memo and kept conversations."""
        self.conversations = {}
        self.parse_memo = ParseMemo()  # (its kept body: a request's size, not the session's to keep)
        packed = finished_turns.pack_turns(self.turns, leaves, self.parse_errors(), self.ignored_controls())
        if packed is None:  # not from the gateway's own bridging: keep the turns, drop their texts
            for turn in self.turns:
                turn.rendered = turn.output_text = ""
            return
        self.packed_turns = packed
        self.turns, self.by_digest = [], {}
        self.history = HistoryDigests()

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

    def note_refusal(self, route: str, exc: Any) -> None:
        """Counts a call refused with `exc` (a `GatewayError`) under `route:field`."""
        key = f"{route}:{exc.param or '-'}"
        entry = self.refused.setdefault(key, {"count": 0, "last": ""})
        entry["count"] += 1
        entry["last"] = exc.message[:500]

    def ignored_controls(self) -> dict[str, int]:
        """The recorded controls (gateway/dialects/controls.py), counted once per call over the session's turns."""
        return count_ignored(self.turns)

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
            turns, parse_errors, ignored = finished_turns.unpack_turns(self.packed_turns, samples)
        else:
            turns, parse_errors = [t.summary() for t in self.turns], self.parse_errors()
            ignored = self.ignored_controls()
        return {
            "session_id": self.session_id,
            "env": self.env,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            "sampling": self.sampling,
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
            "ignored_controls": ignored,
            "refused": self.refused,
            "failed_calls": self.failed_calls,
            "sample_ids": self.sample_ids,
        }
