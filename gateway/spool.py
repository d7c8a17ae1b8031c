"""Durable, append-only sample spool.

Finished samples are appended as JSON lines (`{"cursor": N, "sample": {...}}`) to segment files
under the spool directory and fsync'ed before the reward call that produced them returns. Cursors
are consecutive integers starting at 1; consumers ask for everything after the last cursor they saw
and deduplicate by `sample_id` (a sample re-appended after a crash keeps its id).

On start the spool scans its segments and rebuilds the cursor -> (file, offset) index, so a
gateway killed with SIGKILL and restarted on the same directory serves every acknowledged sample.
A torn last line (the process died mid-write, before the fsync that would have acknowledged it)
is truncated away.
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


@dataclass
class _Loc:
    segment: Path
    offset: int
    length: int


class SampleSpool:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: list[_Loc] = []  # cursor c is at _index[c - 1]
        self._ids: dict[str, int] = {}
        self._segment: Path | None = None
        self._file = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._recover()

    # -- recovery -----------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        return sorted(self.dir.glob("samples-*.jsonl"))

    def _recover(self) -> None:
        for seg in self._segments():
            data = seg.read_bytes()
            offset = 0
            while offset < len(data):
                end = data.find(b"\n", offset)
                if end < 0:  # torn tail: never acknowledged
                    with open(seg, "r+b") as f:
                        f.truncate(offset)
                    break
                line = data[offset:end]
                try:
                    record = json.loads(line)
                    cursor, sample_id = int(record["cursor"]), record["sample"]["sample_id"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise RuntimeError(f"spool segment {seg} is corrupt at byte {offset}: {exc}") from None
                if cursor != len(self._index) + 1:
                    raise RuntimeError(f"spool segment {seg}: cursor {cursor} out of order at byte {offset}")
                self._index.append(_Loc(seg, offset, end - offset))
                self._ids[sample_id] = cursor
                offset = end + 1
        segments = self._segments()
        self._segment = segments[-1] if segments else None

    # -- writing ------------------------------------------------------------------------------
    def _open_segment(self) -> None:
        if self._segment is None or self._segment.stat().st_size >= SEGMENT_BYTES:
            self._segment = self.dir / f"samples-{len(self._segments()) + 1:06d}.jsonl"
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
                cursor = len(self._index) + 1
                line = (
                    json.dumps({"cursor": cursor, "sample": sample}, separators=(",", ":")).encode() + b"\n"
                )
                offset = self._file.tell()
                self._file.write(line)
                self._index.append(_Loc(self._segment, offset, len(line) - 1))
                self._ids[sid] = cursor
                cursors.append(cursor)
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
        return len(self._index)

    def contains(self, sample_id: str) -> bool:
        return sample_id in self._ids

    def read(self, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Records `{"cursor", "sample"}` with cursor > after, at most `limit`."""
        with self._lock:
            locs = self._index[max(after, 0) : max(after, 0) + limit]
        out = []
        handles: dict[Path, Any] = {}
        try:
            for loc in locs:
                f = handles.get(loc.segment) or handles.setdefault(loc.segment, open(loc.segment, "rb"))  # noqa: SIM115
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
