"""The engine request's id list as JSON, without encoding a session's whole history on every call.

SGLang's `/generate` takes every prompt id on every call, so the JSON of the id list grows with the
history (about 6 bytes an id; orjson writes 100k ids in about 1 ms): the largest part of what a
turn's cost still grows by (docs/gateway.md, "Performance"). A session's next prompt almost always
begins with its previous prompt (the bridge appends the answer and the new messages), so
`EncodedIds` keeps, per session, the last prompt's ids and their JSON, and writes a prompt that
begins with them as that JSON plus the new ids' only. The prefix is compared id for id (a list
comparison in C, several times cheaper than writing the ids) against a copy held here, so the bytes
are always `orjson.dumps(ids)`'s; anything else is written whole. Held: at most `max_ids` ids over
all sessions (the least recently used dropped first), only prompts of `min_ids` ids or more.
"""

from __future__ import annotations

from collections import OrderedDict

import orjson

__all__ = ["EncodedIds"]


class EncodedIds:
    """Per session, the last prompt ids sent and their JSON (module doc)."""

    def __init__(self, max_ids: int = 2_000_000, min_ids: int = 2048) -> None:
        self.max_ids = max_ids
        self.min_ids = min_ids
        self.reused = 0  # ids not written again (tests, benches)
        self._last: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()
        self._held = 0

    def dumps(self, key: str, ids: list[int]) -> bytes:
        """`orjson.dumps(ids)`, byte for byte, reusing `key`'s last prompt's JSON where `ids` begins
        with that prompt."""
        out = None
        entry = self._last.pop(key, None)
        if entry is not None:
            prev, encoded = entry
            self._held -= len(prev)
            n = len(prev)
            if len(ids) >= n and ids[:n] == prev:
                out = encoded if len(ids) == n else encoded[:-1] + b"," + orjson.dumps(ids[n:])[1:]
                self.reused += n
        if out is None:
            out = orjson.dumps(ids)
        if self.min_ids <= len(ids) <= self.max_ids:
            self._last[key] = (list(ids), out)  # a copy: the caller's list may change after the call
            self._held += len(ids)
            while self._held > self.max_ids:
                dropped, _ = self._last.popitem(last=False)[1]
                self._held -= len(dropped)
        return out
