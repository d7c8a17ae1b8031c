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
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEGMENT_BYTES = 64 << 20
ACK_FILE = "acked"


@dataclass
class _Loc:
    segment: Path
    offset: int
    length: int


class SampleSpool:
    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES, delete_acked: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.delete_acked = delete_acked
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
                    cursor, sample_id = int(record["cursor"]), record["sample"]["sample_id"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise RuntimeError(f"spool segment {seg} is corrupt at byte {offset}: {exc}") from None
                if not self._index and not self._ids:
                    self._base = cursor - 1  # the first kept record (earlier segments were deleted)
                if cursor != self._base + len(self._index) + 1:
                    raise RuntimeError(f"spool segment {seg}: cursor {cursor} out of order at byte {offset}")
                self._index.append(_Loc(seg, offset, end - offset))
                self._ids[sample_id] = cursor
                offset = end + 1
        self._segment = segments[-1] if segments else None

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
            for sample in samples:
                sid = sample["sample_id"]
                if sid in self._ids:
                    cursors.append(self._ids[sid])
                    continue
                cursor = self.last_cursor + 1
                line = (
                    json.dumps({"cursor": cursor, "sample": sample}, separators=(",", ":")).encode() + b"\n"
                )
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

    def read(self, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Records `{"cursor", "sample"}` with cursor > after (from the first kept one), at most
        `limit`; the last one counts as delivered (`backlog`)."""
        with self._lock:
            start = max(after - self._base, 0)
            locs = self._index[start : start + limit]
            if locs:
                self.delivered = max(self.delivered, self._base + start + len(locs))
        out = []
        handles: dict[Path, Any] = {}
        try:
            for loc in locs:
                f = handles.get(loc.segment)
                if f is None:
                    try:
                        f = handles[loc.segment] = open(loc.segment, "rb")  # noqa: SIM115
                    except FileNotFoundError:  # acknowledged and deleted since: the reader is behind the ack
                        continue
                f.seek(loc.offset)
                out.append(json.loads(f.read(loc.length)))
        finally:
            for f in handles.values():
                f.close()
        return out

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
