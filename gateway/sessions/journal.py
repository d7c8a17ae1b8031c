"""The session journal: every open session's history, appended as it happens to files in the spool
directory, so that a gateway restarted on the same directory continues each session exactly.

    journal = SessionJournal(spool_dir, fsync="batch", interval_s=0.05)
    sessions, last_turn_id = replay.restore(journal.recover(), decode)   # at start (gateway/sessions/replay.py)
    journal.opened(session); journal.turn(session, turn, ...); journal.failed(session, call)
    journal.sync(); <samples appended to the spool>; journal.finished(session, answer)

**Format.** Segment files `journal-NNNNNN.log`; each is a sequence of records framed as
`<u32 payload length><u32 crc32 of the payload>` (little-endian) + the payload, an orjson object:

    {"k": "open", "sid": ..., "s": {the session's plain fields: env, task_id, group_id, metadata,
                                     created, and any other plain field, e.g. its token}}
    {"k": "turn", "sid": ..., "t": {one recorded Turn, see `SessionJournal.turn`}}
    {"k": "fail", "sid": ..., "c": {a failed engine call, as on the session}}
    {"k": "fin",  "sid": ..., "a": {status, reward, metrics, sample_ids, cursors, sampled_tokens}}

A turn record holds what cannot be recomputed: its ids (the prompt as the tokens after the
parent's prompt + output, so the journal grows with the tokens sampled, not with history squared;
a fork's prompt, which has no parent, as `"base": [turn id, n]` and the tokens after the first n of
that earlier turn's prompt + output: the session's earlier turn it shares the most with, when that is
at least `shared_prefix.MIN_SHARED` tokens; older journals: whole),
logprobs, weight versions, finish reason, parse status, fork reason, and for a chat turn the
request's messages (as the ones after those of the session's previous journaled call), the reply
and the template context (tools, template arguments; only when changed). The digests the bridge
looks parents up by are Python `hash()`es, which differ per process, so `restore` recomputes them
from those messages; the decoded output text is recomputed from the ids; the rendered history is
left empty (the bridge renders the parent's request again when it needs it).

**Torn records.** A record cut by a crash (short header, short payload, wrong crc) can only be the
last one written; recovery truncates the last segment there. A bad record in an earlier segment
is corruption and stops the start with the file and offset.

**fsync policy** (`journal_fsync`): `always` fsyncs each record before the call that made it
answers; `batch` has a thread fsync at most every `interval_s`; `off` never fsyncs. Every record is
written to the file (one `write`) before the call answers, so under any policy a killed process
loses nothing; the policy decides what a power loss or kernel crash may lose. The journal is always
fsynced before a session's samples go to the spool, so a session's turns are durable before its
samples are.

**Compaction.** Each start writes a new segment, and a segment is started every `segment_bytes`.
A segment is deleted once no open session has a record in it and every older segment is gone
(oldest first, so a `fin` record never outlives the records it closes).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from palaestra.gateway.sessions import shared_prefix
from palaestra.gateway.sessions.session import Session
from palaestra.gateway.sessions.trajectory import Turn

__all__ = ["FSYNC_POLICIES", "NOT_PERSISTED", "SessionJournal"]

log = logging.getLogger("palaestra.gateway.sessions.journal")

FSYNC_POLICIES = ("always", "batch", "off")
FsyncPolicy = Literal["always", "batch", "off"]
_HEADER = struct.Struct("<II")

# Session fields the journal rebuilds from its own records (or that mean nothing in another
# process); every other field of a new session is written in its "open" record.
NOT_PERSISTED = frozenset(
    {
        "turns",
        "by_digest",
        "forks",
        "failed_calls",
        "history",
        "parse_memo",
        "conversations",
        "finished",
        "status",
        "reward",
        "metrics",
        "sample_ids",
        "cursors",
        "sampled_tokens",
        "finish_lock",
        "last_active",
        "busy",
    }
)


@dataclass
class _Segment:
    path: Path
    size: int = 0
    live: set[str] = field(default_factory=set)  # open sessions with a record here


@dataclass
class _Last:
    """What the session's previous journaled chat call was: its turn, messages and context."""

    turn_id: int
    call_id: str
    prompt_len: int | None = None  # None: the next turn is not a sibling of this one
    messages: list[dict[str, Any]] | None = None
    context: bytes | None = None


def _plain(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except TypeError:
        return False
    return True


class SessionJournal:
    """Append-only, checksummed session records in `directory` (see the module doc)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync: FsyncPolicy = "batch",
        interval_s: float = 0.05,
        segment_bytes: int = 16 << 20,
        share_prefixes: bool = True,
    ):
        """`share_prefixes` off writes a fork's prompt whole (as before forks shared; bench/fork_storage.py)."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"journal_fsync must be one of {', '.join(FSYNC_POLICIES)}; got {fsync!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.interval_s = interval_s
        self.segment_bytes = segment_bytes
        self.share_prefixes = share_prefixes
        self._segments: list[_Segment] = []
        self._where: dict[str, list[_Segment]] = {}  # open session -> segments with its records
        self._last: dict[str, _Last] = {}
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._dirty = False
        self._wake = threading.Event()  # set when a write makes the file dirty (batch's thread waits on it)
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self.records: dict[str, int] = {"open": 0, "turn": 0, "fail": 0, "fin": 0}
        self.fsyncs = 0
        self.torn_bytes = 0  # dropped from the tail at the last recovery
        self.segments_deleted = 0

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self._segments)

    # -- recovery -----------------------------------------------------------------------------
    def recover(self) -> list[dict[str, Any]]:
        """Every record of the existing segments, in order (a torn tail of the last one is cut off);
        then opens a new segment for writing. Call once, before any write."""
        paths = sorted(self.dir.glob("journal-*.log"))
        records: list[dict[str, Any]] = []
        finished: set[str] = set()
        for i, path in enumerate(paths):
            data = path.read_bytes()
            seg = _Segment(path)
            offset = 0
            while offset < len(data):
                record, end = _frame_at(data, offset)
                if record is None:
                    if i < len(paths) - 1:
                        raise RuntimeError(f"session journal {path} is corrupt at byte {offset}")
                    with open(path, "r+b") as f:  # a torn tail: the process died writing it
                        f.truncate(offset)
                        f.flush()
                        os.fsync(f.fileno())
                    self.torn_bytes = len(data) - offset
                    log.warning("session journal: dropped a torn record of %d bytes", self.torn_bytes)
                    break
                records.append(record)
                sid = record["sid"]
                if record["k"] == "fin":
                    finished.add(sid)
                elif sid not in finished:
                    seg.live.add(sid)
                offset = end
            seg.size = offset
            self._segments.append(seg)
        for seg in self._segments:
            seg.live -= finished
            for sid in seg.live:
                self._where.setdefault(sid, []).append(seg)
        with self._lock:
            self._rotate()
        if self.fsync == "batch":
            self._flusher = threading.Thread(target=self._flush_loop, name="journal-fsync", daemon=True)
            self._flusher.start()
        return records

    # -- writing ------------------------------------------------------------------------------
    def _rotate(self) -> None:
        """Seals the segment being written (fsynced) and starts the next one. Holds the lock."""
        if self._fd is not None:
            if self.fsync != "off":
                os.fsync(self._fd)
                self.fsyncs += 1
            os.close(self._fd)
        number = int(self._segments[-1].path.stem.split("-")[1]) + 1 if self._segments else 1
        seg = _Segment(self.dir / f"journal-{number:06d}.log")
        self._fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segments.append(seg)
        _fsync_dir(self.dir)
        self._compact()

    def _write(self, kind: str, sid: str, body_key: str, body: dict[str, Any], live: bool = True) -> None:
        payload = orjson.dumps({"k": kind, "sid": sid, body_key: body})
        frame = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            assert self._fd is not None, "SessionJournal.recover() must run before writes"
            if self._segments[-1].size >= self.segment_bytes:
                self._rotate()
            seg = self._segments[-1]
            view = memoryview(frame)
            while view:  # one write in practice; a regular file may still take less
                view = view[os.write(self._fd, view) :]
            seg.size += len(frame)
            if live and sid not in seg.live:
                seg.live.add(sid)
                self._where.setdefault(sid, []).append(seg)
            if self.fsync == "always":
                os.fsync(self._fd)
                self.fsyncs += 1
            elif not self._dirty:
                self._dirty = True
                self._wake.set()
        self.records[kind] += 1

    def sync(self) -> None:
        """fsyncs what was written (not with `off`). Safe from any thread."""
        if self.fsync == "off":
            return
        with self._lock:
            if not self._dirty or self._fd is None:
                return
            self._dirty = False
            fd = os.dup(self._fd)  # fsync outside the lock: writers (the event loop) never wait on the disk
        try:
            os.fsync(fd)
            self.fsyncs += 1
        finally:
            os.close(fd)

    def _flush_loop(self) -> None:
        """fsyncs `interval_s` after a write makes the file dirty, with what was written meanwhile.
        It sleeps while nothing is written: polling every `interval_s` woke an idle gateway 20 times
        a second (~2.3 ms of CPU a second here; docs/gateway.md, "Idle wake-ups")."""
        while True:
            self._wake.wait()
            if self._stop.wait(self.interval_s):
                return  # close() syncs what is left
            # cleared before the sync: a write after the sync's check sets it again; one before it
            # is in the file when the sync's fsync runs
            self._wake.clear()
            self.sync()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _compact(self) -> None:
        """Deletes the oldest segments while no open session has a record in them. Holds the lock."""
        deleted = False
        while len(self._segments) > 1 and not self._segments[0].live:
            self._segments.pop(0).path.unlink(missing_ok=True)
            self.segments_deleted += 1
            deleted = True
        if deleted:
            _fsync_dir(self.dir)

    # -- records ------------------------------------------------------------------------------
    def opened(self, session: Session) -> None:
        """A new session: its plain fields (any a later version adds, e.g. a token, included)."""
        fields = {
            f.name: getattr(session, f.name)
            for f in dataclasses.fields(session)
            if f.init and f.name not in NOT_PERSISTED and _plain(getattr(session, f.name))
        }
        self._write("open", session.session_id, "s", fields)

    def turn(
        self,
        session: Session,
        turn: Turn,
        messages: list[dict[str, Any]] | None = None,
        reply: dict[str, Any] | None = None,
        context: bytes | None = None,
        keep: int | None = None,
    ) -> None:
        """A recorded turn. Chat turns pass the request's `messages` (after any kept Responses
        conversation was put in), the `reply` message, the template `context` bytes whose hash is the
        turn's context key, and `keep` (the preamble length) when the call's conversation is kept."""
        if session.finished:  # a call that was in flight when the session finished: not replayed
            return
        sid = session.session_id
        last = self._last.get(sid)
        parent = turn.parent
        t: dict[str, Any] = {
            "id": turn.turn_id,
            "call": turn.call_id,
            "choice": turn.choice,
            "parent": parent.turn_id if parent is not None else None,
            "out": turn.output_ids,
            "lp": turn.output_logprobs,
            "wv": turn.weight_version,
            "spans": [s.to_wire() for s in turn.weight_spans],
            "fin": turn.finish_reason.wire,
            "lat": turn.latency_s,
            "cached": turn.cached_tokens,
            "kind": turn.kind,
            "had_r": turn.had_reasoning,
            "parse": turn.parse,
            "controls": turn.controls,
            "fork": turn.fork_reason,
            "fork_detail": turn.fork_detail,
            "created": turn.created,
        }
        if turn.constrained:  # sampled under a regex / JSON schema / grammar (older journals: never)
            t["con"] = True
        if turn.routed is not None:  # routing replay: the experts of positions [start, end), base64
            t["routed"] = turn.routed.to_wire()
        # the choices of one call share its prompt (one plan)
        if last is not None and last.call_id == turn.call_id and last.prompt_len == turn.prompt_len:
            t["sib"] = last.turn_id  # another choice of the same call: same prompt, messages, context
        else:
            if parent is not None:
                t["tail"] = turn.tokens[parent.end : turn.prompt_len]
            else:
                prompt = turn.prompt()
                base, n = self._fork_base(session, turn, prompt)
                if base is not None:
                    t["base"] = [base.turn_id, n]
                t["prompt"] = prompt[n:]
            if messages is not None:
                known = last.messages if last is not None and last.messages is not None else []
                # identity: HistoryDigests shares them. The usual call repeats all of the previous
                # one's messages: checked in C, so this does not cost a Python step per message.
                if len(known) <= len(messages) and all(map(operator.is_, known, messages)):
                    k = len(known)
                else:
                    k = 0
                    for a, b in zip(known, messages, strict=False):
                        if a is not b:
                            break
                        k += 1
                t["msgs"] = [k, messages[k:]]
                if context is not None and (last is None or context != last.context):
                    t["ctx"] = context.decode()
            if turn.kind == "completion":
                if parent is not None and turn.rendered.startswith(parent.rendered):
                    t["rtail"] = turn.rendered[len(parent.rendered) :]
                else:
                    t["rendered"] = turn.rendered
        if reply is not None:
            t["reply"] = reply
        if keep is not None:
            t["keep"] = keep
        self._write("turn", sid, "t", t)
        if messages is not None:
            self._last[sid] = _Last(
                turn.turn_id,
                turn.call_id,
                turn.prompt_len,
                messages,
                context if context is not None else (last.context if last else None),
            )
        elif last is not None:
            last.prompt_len = None

    def _fork_base(self, session: Session, turn: Turn, prompt: list[int]) -> tuple[Turn | None, int]:
        """The session's earlier turn whose prompt + output shares the most leading tokens with
        `turn`'s `prompt`, and how many; (None, 0) below `MIN_SHARED`. A leaf's tokens begin with its
        ancestors', so the leaves are the only candidates. The first leaf that shares the whole
        prompt ends the search (no later one can share more), and a leaf whose tokens are no longer
        than the best share so far is not compared: a session that forks on every call (a client
        resending the same start) would otherwise compare every earlier fork on each call."""
        if not self.share_prefixes:
            return None, 0
        best, most, whole = None, 0, len(prompt)
        for other in session.turns:
            if other.children == 0 and other.call_id != turn.call_id and other.end > most:
                n = shared_prefix.shared_with_turn(prompt, other)
                if n > most:
                    best, most = other, n
                    if most == whole:
                        break
        return (best, most) if most >= shared_prefix.MIN_SHARED else (None, 0)

    def failed(self, session: Session, call: dict[str, Any]) -> None:
        if not session.finished:
            self._write("fail", session.session_id, "c", call)

    def finished(self, session_id: str, answer: dict[str, Any]) -> None:
        """The session's samples are durable in the spool: it is closed, its segments may go."""
        self._write("fin", session_id, "a", answer, live=False)
        self._last.pop(session_id, None)
        with self._lock:
            for seg in self._where.pop(session_id, []):
                seg.live.discard(session_id)
            self._compact()


def _frame_at(data: bytes, offset: int) -> tuple[dict[str, Any] | None, int]:
    """The record at `offset` and the offset after it; None when it is torn or corrupt."""
    if offset + _HEADER.size > len(data):
        return None, offset
    length, crc = _HEADER.unpack_from(data, offset)
    start, end = offset + _HEADER.size, offset + _HEADER.size + length
    if end > len(data) or zlib.crc32(data[start:end]) != crc:
        return None, offset
    try:
        record = orjson.loads(data[start:end])
    except orjson.JSONDecodeError:
        return None, offset
    return record, end


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
