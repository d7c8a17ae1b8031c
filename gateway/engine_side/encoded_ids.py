"""The engine request's id list as JSON, without encoding a session's whole history on every call.

SGLang's `/generate` takes every prompt id on every call, so the JSON of the id list grows with the
history (about 6 bytes an id; orjson writes 100k ids in about 1 ms): the largest part of what a
turn's cost still grows by (docs/gateway.md, "Performance"). A bridged prompt is a `PromptIds`: its
turn's tokens list (`base`, only ever appended to) up to the parent's end, then the bridge
(`tail`). `EncodedIds` keeps, per session, the JSON of the last such prompt with its `base`,
`start` and `tail` (references, not copies), and writes the next prompt on the same `base` whose
known part reaches past them as that JSON plus the new ids': the ids before `start` are `base`'s by
construction, and only the last prompt's `tail` is compared with what `base` holds there (the
previous answer's bridge, not the history). The bytes are always `orjson.dumps(ids)`'s; any other
prompt (a plain list: a fork, a continuation after a weight update) is written whole. Held: the JSON
of at most `max_ids` ids over all sessions (the least recently used dropped first), only prompts of
`min_ids` ids or more; a session's dropped when it ends (`forget`: the JSON also holds its `base`).

The JSON is kept and handed out in pieces (`pieces`: the engine client passes them on as the body's
pieces, which the bare HTTP client writes as they are, one `writev`, and aiohttp's joins): each
`bytes + bytes` of a 600 KB list is a fresh allocation of its size, and three of them per call (drop
the "]", add the new ids, join into the body) cost more than the new ids' JSON. A session's pieces
are joined into one after `MAX_PIECES`. Every piece is immutable (bytes, or a view of bytes), so a
write the socket takes later still sends what was written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import orjson

from palaestra.gateway.sessions.trajectory import PromptIds, list_of

__all__ = ["EncodedIds"]


MAX_PIECES = 32


class _Sent(NamedTuple):
    """A prompt written: `b"".join(head) + b"]" == orjson.dumps(base[:start] + tail)` as it was when
    written (`head`: its JSON without the closing bracket, in pieces)."""

    base: list[int]
    start: int
    tail: list[int]
    head: tuple[bytes | memoryview, ...]


class EncodedIds:
    """Per session, the last bridged prompt's JSON and what it was made of (module doc)."""

    def __init__(self, max_ids: int = 2_000_000, min_ids: int = 2048) -> None:
        self.max_ids = max_ids
        self.min_ids = max(1, min_ids)  # an empty list's JSON "[]" cannot be extended
        self.reused = 0  # ids not written again (tests, benches)
        self._last: OrderedDict[str, _Sent] = OrderedDict()
        self._held = 0  # ids whose JSON is held

    def forget(self, key: str) -> None:
        """Drops `key`'s JSON (its session ended): what is held also keeps its token list alive."""
        sent = self._last.pop(key, None)
        if sent is not None:
            self._held -= sent.start + len(sent.tail)

    def dumps(self, key: str, ids: Sequence[int]) -> bytes:
        """`orjson.dumps(ids)`, byte for byte (`pieces`, joined)."""
        return b"".join(self.pieces(key, ids))

    def pieces(self, key: str, ids: Sequence[int]) -> list[bytes | memoryview]:
        """`orjson.dumps(ids)` in pieces (their join is it byte for byte), reusing `key`'s last bridged
        prompt's JSON where `ids` is a `PromptIds` known to begin with that prompt."""
        if not isinstance(ids, PromptIds):
            return [orjson.dumps(list_of(ids))]
        head = None
        sent = self._last.pop(key, None)
        if sent is not None:
            n = sent.start + len(sent.tail)  # the ids `sent.head` writes
            self._held -= n
            # `base` only grows, so its first `sent.start` ids are still the ones written; the tail's
            # (the bridge then) must be what `base` holds after them now (the turn appended it)
            if ids.base is sent.base and ids.start >= n and sent.base[sent.start : n] == sent.tail:
                head = sent.head
                if len(ids) > n:  # "[a,b" + ",c,d": the new ids' JSON without its brackets
                    new = ids.base[n : ids.start] + ids.tail  # ids[n:], not copying what is before
                    head += (b",", memoryview(orjson.dumps(new))[1:-1])
                    if len(head) > MAX_PIECES:
                        head = (b"".join(head),)
                self.reused += n
        if head is None:
            head = (memoryview(orjson.dumps(ids.list()))[:-1],)
        if self.min_ids <= len(ids) <= self.max_ids:
            self._last[key] = _Sent(ids.base, ids.start, ids.tail, head)
            self._held += len(ids)
            while self._held > self.max_ids:
                dropped = self._last.popitem(last=False)[1]
                self._held -= dropped.start + len(dropped.tail)
        return [*head, b"]"]
