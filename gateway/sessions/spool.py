"""Durable, append-only sample spool.

Finished samples are appended as JSON lines (`{"cursor": N, "sample": {...}}`) to segment files
under the spool directory and fsync'ed before the reward call that produced them returns. Cursors
are consecutive integers starting at 1; consumers ask for everything after the last cursor they saw
and deduplicate by `sample_id` (a sample re-appended after a crash keeps its id).

On start the spool scans its segments and rebuilds the cursor -> (file, offset) index, so a
gateway killed with SIGKILL and restarted on the same directory serves every acknowledged sample.
A torn last line (the process died mid-write, before the fsync that would have acknowledged it)
is truncated away.

Retention: a consumer acknowledges a cursor (`ack`, `POST /samples/ack`) once everything up to it
is consumed for good (the trainer: once a checkpoint records that cursor). The acknowledged cursor
is kept in `acked` (written atomically), and sealed segments whose samples are all acknowledged are
deleted (unless `delete_acked` is off), so the spool's disk use follows the consumer. Cursors keep
counting across deletions; a read before the first kept cursor starts at it (`first_cursor`).
`delivered` is the highest cursor handed to a reader; the backlog is what is durable and neither
delivered nor acknowledged.

Forks share their prefix: a session's samples are appended together, and a sample that shares at
least `shared_prefix.MIN_SHARED` leading tokens with an earlier one of the same append (a fork of
the same session) is written as `{"cursor": N, "ref": [parent cursor, n], "part": {...}}`: the
sample less the parent's first n tokens (gateway/sessions/shared_prefix.py). `read` expands it, so
every reader sees the whole sample as before; records written before this (`"sample"` whole)
read as they are. A parent is always in its child's segment (one append writes to one segment, and
a reference never reaches outside its append), and a segment is deleted only when every cursor in it
is acknowledged, so no parent goes while a child that references it is unacknowledged.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.gateway.sessions import shared_prefix

SEGMENT_BYTES = 64 << 20
ACK_FILE = "acked"
MAX_DEPTH = 16
"""The longest chain of references a sample may sit at the end of (a reader parses the chain)."""


@dataclass
class _Loc:
    segment: Path
    offset: int
    length: int


class SampleSpool:
    def __init__(
        self,
        directory: str | Path,
        segment_bytes: int = SEGMENT_BYTES,
        delete_acked: bool = True,
        share_prefixes: bool = True,
    ):
        """`share_prefixes` off writes every sample whole (as before forks shared; bench/fork_storage.py)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.delete_acked = delete_acked
        self.share_prefixes = share_prefixes
        self._lock = threading.Lock()
        self._base = (
            0  # cursors up to _base were deleted (acknowledged): cursor c is at _index[c - 1 - _base]
        )
        self._index: list[_Loc] = []
        self._ids: dict[str, int] = {}
        self._segment: Path | None = None
        self._file = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.acked = self._read_ack()
        self.delivered = 0
        self.bytes = 0  # of the segments on disk
        self.segments_deleted = 0
        self._recover()
        self._retain()

    # -- recovery -----------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        return sorted(self.dir.glob("samples-*.jsonl"))

    def _read_ack(self) -> int:
        try:
            return int((self.dir / ACK_FILE).read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError as exc:
            raise RuntimeError(f"spool {self.dir / ACK_FILE} is corrupt: {exc}") from None

    def _recover(self) -> None:
        segments = self._segments()
        self._base = self.acked  # everything acknowledged may be gone; the first kept record says
        for seg in segments:
            data = seg.read_bytes()
            self.bytes += len(data)
            offset = 0
            while offset < len(data):
                end = data.find(b"\n", offset)
                if end < 0:  # torn tail: never acknowledged
                    with open(seg, "r+b") as f:
                        f.truncate(offset)
                    self.bytes -= len(data) - offset
                    break
                line = data[offset:end]
                try:
                    record = json.loads(line)
                    cursor = int(record["cursor"])
                    sample_id = (record["part"] if "ref" in record else record["sample"])["sample_id"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise RuntimeError(f"spool segment {seg} is corrupt at byte {offset}: {exc}") from None
                if not self._index and not self._ids:
                    self._base = cursor - 1  # the first kept record (earlier segments were deleted)
                if cursor != self._base + len(self._index) + 1:
                    raise RuntimeError(f"spool segment {seg}: cursor {cursor} out of order at byte {offset}")
                if "ref" in record and not self._in_segment(record["ref"][0], cursor, seg):
                    raise RuntimeError(
                        f"spool segment {seg} is corrupt at byte {offset}: cursor {cursor} references "
                        f"cursor {record['ref'][0]}, which is not an earlier record of this segment"
                    )
                self._index.append(_Loc(seg, offset, end - offset))
                self._ids[sample_id] = cursor
                offset = end + 1
        self._segment = segments[-1] if segments else None

    def _in_segment(self, parent: Any, cursor: int, seg: Path) -> bool:
        if not isinstance(parent, int) or not self._base < parent < cursor:
            return False
        return self._index[parent - 1 - self._base].segment == seg

    # -- retention ----------------------------------------------------------------------------
    def ack(self, cursor: int) -> int:
        """Records that everything up to `cursor` is consumed for good (monotonic: a lower cursor
        changes nothing) and deletes the sealed segments that holds only; returns the segments
        deleted. Raises ValueError for a cursor beyond the last one."""
        if cursor > self.last_cursor:
            raise ValueError(f"cursor {cursor} is beyond the last durable cursor {self.last_cursor}")
        with self._lock:
            if cursor <= self.acked:
                return 0
            tmp = self.dir / (ACK_FILE + ".tmp")
            with open(tmp, "w") as f:
                f.write(str(cursor))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / ACK_FILE)
            _fsync_dir(self.dir)
            self.acked = cursor
        return self._retain()

    def _retain(self) -> int:
        """Deletes sealed segments whose every cursor is acknowledged (never the one appended to)."""
        if not self.delete_acked:
            return 0
        deleted = 0
        with self._lock:
            while self._index and self._index[0].segment != self._segment:
                seg = self._index[0].segment
                n = next((i for i, loc in enumerate(self._index) if loc.segment != seg), len(self._index))
                if self._base + n > self.acked:
                    break
                ids = [sid for sid, c in self._ids.items() if c <= self._base + n]
                for sid in ids:
                    del self._ids[sid]
                self.bytes -= seg.stat().st_size
                seg.unlink()
                del self._index[:n]
                self._base += n
                deleted += 1
            if deleted:
                _fsync_dir(self.dir)
                self.segments_deleted += deleted
        return deleted

    @property
    def first_cursor(self) -> int:
        """The first cursor still on disk (last_cursor + 1 when none is)."""
        return self._base + 1

    @property
    def backlog(self) -> int:
        """Durable samples neither delivered to a reader nor acknowledged."""
        return self.last_cursor - max(self.delivered, self.acked, self._base)

    # -- writing ------------------------------------------------------------------------------
    def _open_segment(self) -> None:
        if self._segment is None or self._segment.stat().st_size >= self.segment_bytes:
            segments = self._segments()
            number = int(segments[-1].stem.split("-")[1]) + 1 if segments else 1
            self._segment = self.dir / f"samples-{number:06d}.jsonl"
            self._segment.touch()
            _fsync_dir(self.dir)
        if self._file is None or self._file.name != str(self._segment):
            if self._file is not None:
                self._file.close()
            self._file = open(self._segment, "ab")  # noqa: SIM115 - kept open for appends

    def append(self, samples: list[dict[str, Any]]) -> list[int]:
        """Appends samples durably (fsync) and returns their cursors; known sample_ids are not re-added."""
        with self._lock:
            cursors = []
            self._open_segment()
            assert self._file is not None and self._segment is not None
            written: list[tuple[int, dict[str, Any], int]] = []  # (cursor, sample, depth) of this append
            for sample in samples:
                sid = sample["sample_id"]
                if sid in self._ids:
                    cursors.append(self._ids[sid])
                    continue
                cursor = self.last_cursor + 1
                record, depth = self._record(cursor, sample, written)
                written.append((cursor, sample, depth))
                line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
                offset = self._file.tell()
                self._file.write(line)
                self._index.append(_Loc(self._segment, offset, len(line) - 1))
                self._ids[sid] = cursor
                cursors.append(cursor)
                self.bytes += len(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        self._wake()
        return cursors

    def _record(
        self, cursor: int, sample: dict[str, Any], written: list[tuple[int, dict[str, Any], int]]
    ) -> tuple[dict[str, Any], int]:
        """The line for `sample` and its depth in a chain of references: against the sample of this
        append (same session) it shares the most leading tokens with, or whole (also a record that
        is not a session's sample: no `session_id` or `tokens`)."""
        session = sample.get("session_id")
        if self.share_prefixes and session is not None and "tokens" in sample:
            best, most = None, 0
            for parent in written:
                _, other, depth = parent
                if other.get("session_id") == session and "tokens" in other and depth < MAX_DEPTH:
                    n = shared_prefix.common_prefix(sample["tokens"], other["tokens"])
                    if n >= most:
                        best, most = parent, n
            if best is not None and (found := shared_prefix.delta(sample, best[1])) is not None:
                n, part = found
                return {"cursor": cursor, "ref": [best[0], n], "part": part}, best[2] + 1
        return {"cursor": cursor, "sample": sample}, 0

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # -- reading ------------------------------------------------------------------------------
    @property
    def last_cursor(self) -> int:
        return self._base + len(self._index)

    def contains(self, sample_id: str) -> bool:
        return sample_id in self._ids

    def cursor_of(self, sample_id: str) -> int | None:
        return self._ids.get(sample_id)

    def read(self, after: int = 0, limit: int = 100, deliver: bool = True) -> list[dict[str, Any]]:
        """Records `{"cursor", "sample"}` with cursor > after (from the first kept one), at most
        `limit`, each sample whole (a reference expanded); the last one counts as delivered (`backlog`)
        unless `deliver` is False (a read that is not the trainer's feed)."""
        with self._lock:
            start = max(after - self._base, 0)
            locs = self._index[start : start + limit]
            if locs and deliver:
                self.delivered = max(self.delivered, self._base + start + len(locs))
        out = []
        handles: dict[Path, Any] = {}
        whole: dict[int, dict[str, Any]] = {}  # cursor -> sample, for the references that follow
        try:
            for loc in locs:
                f = handles.get(loc.segment)
                if f is None:
                    try:
                        f = handles[loc.segment] = open(loc.segment, "rb")  # noqa: SIM115
                    except FileNotFoundError:  # acknowledged and deleted since: the reader is behind the ack
                        continue
                sample = self._sample(_line(f, loc), f, whole)
                if sample is not None:
                    out.append(sample)
        finally:
            for f in handles.values():
                f.close()
        return out

    def _sample(
        self, record: dict[str, Any], f: Any, whole: dict[int, dict[str, Any]]
    ) -> dict[str, Any] | None:
        """`record` as `{"cursor", "sample"}` with the sample whole, its parents read from `f` (its
        segment, open); None when a parent is no longer indexed (deleted: the reader is behind the ack)."""
        cursor = record["cursor"]
        if "ref" not in record:
            whole[cursor] = record["sample"]
            return record
        parent_cursor, n = record["ref"]
        parent = whole.get(parent_cursor)
        if parent is None:
            with self._lock:
                i = parent_cursor - 1 - self._base
                loc = self._index[i] if 0 <= i < len(self._index) else None
            if loc is None:
                return None
            got = self._sample(_line(f, loc), f, whole)
            if got is None:
                return None
            parent = got["sample"]
        sample = whole[cursor] = shared_prefix.expand(record["part"], n, parent)
        return {"cursor": cursor, "sample": sample}

    async def wait_for(self, after: int, timeout: float) -> bool:
        """Waits until a cursor > after exists (True) or the timeout passes (False)."""
        if self.last_cursor > after:
            return True
        event = asyncio.Event()
        with self._lock:
            self._waiters.append((asyncio.get_running_loop(), event))
        if self.last_cursor > after:
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return self.last_cursor > after
        return True

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_segment(path: str | Path) -> list[dict[str, Any]]:
    """The samples of one segment file, whole (references expanded), for a reader of the files
    (a test, a post-mortem) that must not recover, retain or index as a `SampleSpool` does."""
    whole: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_bytes().splitlines():
        record = json.loads(line)
        if "ref" in record:
            parent, n = record["ref"]
            whole[record["cursor"]] = shared_prefix.expand(record["part"], n, whole[parent])
        else:
            whole[record["cursor"]] = record["sample"]
    return list(whole.values())


def _line(f: Any, loc: _Loc) -> dict[str, Any]:
    f.seek(loc.offset)
    return json.loads(f.read(loc.length))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
