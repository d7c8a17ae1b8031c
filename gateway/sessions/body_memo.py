"""A session's last request body, so that a call parses only the bytes its body adds.

Agents send their whole conversation on every call: at a 100k-token history a chat body is about
490 KB, and parsing all of it (`guards.read_json`) grew to half a millisecond a call. The body of
a session's next call almost always repeats the previous one up to the end of its history array's
last item, then adds items and closes the object with the same few keys. `BodyMemo` keeps, per
session, the previous body's bytes up to that point (`prefix`) and the items they parsed to; a body
that starts with `prefix` (one byte compare) is parsed as three pieces, each by orjson:

* the keys before the history array (`head`: the prefix up to the array, with `null` in its place);
* the new items, `[` + the bytes after the prefix up to the array's closing bracket + `]`;
* the keys after the array, `{` + the bytes after its `,`.

A body that changed one of the previous body's last `ENDS` items (Anthropic clients move their
cache marker to the newest message) is parsed the same way from the end of the last item it kept.

The body is the head's object with the previous items plus the new ones under the history key and
the rest's keys set after: the same key order and the same last-wins duplicates as one parse of
the whole body (a dict keeps a repeated key where it first came and takes its last value). Pieces
that each parse make a whole that parses to the same values, so the only checks left are those
orjson or `read_json` make across pieces: nesting depth (the new items and the rest are checked at
the depth they sit in the body) and the history key written twice. Anything unexpected (no
prefix, an invalid piece, a depth or duplicate problem, a key missing or not an array) falls back
to `read_json` of the whole body, which refuses a bad body with its usual 400.

Where a body's array ends is found by a small scanner (`_close`): a regular expression skips the
bytes between brackets and short strings (escapes included) in C, long strings are skipped from
quote to quote by `bytes.find`, and Python takes a step per bracket and per long string. It runs
over the new items only, and over the whole body once after a full parse (`_locate`), when the body
is known valid (0.2-0.4 ms for the 508 KB body of bench/body_parse.py's 100k-token session, about
one orjson parse of it). A session whose bodies stop repeating each other (`MISSES` in a row) is
then scanned one body in `RETRY` until they repeat again; bodies under `MIN_BYTES` are parsed whole and not kept.

Reusing the previous call's item objects is sound because nothing edits parsed request items in
place: the dialects' converters and `renderer.normalize_more` build new messages (or keep an item
that is already in the internal form as it is), the templates run in jinja's immutable sandbox, and
`history.ParseMemo` already reused the messages. `ParseMemo.read_body` marks the list of items it
hands out as trusted, which lets the parse memo skip writing the whole history back to JSON to find
what it repeats (tests/gateway/test_body_memo.py checks after real calls that the kept items still
equal the kept bytes).

Memory, per open session: the body's bytes up to its last item and references to its items (whose
strings the parse memo's messages share). The parse memo no longer keeps the history's JSON for
trusted items, so a 64-turn, 100k-token session's memo holds less than before: 1.07-1.11 MB against
1.59 MB (tracemalloc after the session's 64 parses, each dialect). `Session.release` drops it when
the session finishes; eviction drops it with the session.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from palaestra.gateway.guards import MAX_JSON_DEPTH, too_deep

__all__ = ["ENDS", "MIN_BYTES", "MISSES", "RETRY", "BodyMemo"]

MISSES = 3
"""Bodies parsed whole in a row (none repeating the one before) that are scanned to be kept; after
them only every `RETRY`-th is, until one repeats its predecessor again (an agent that rewrites its
history every call, or two conversations on one session, then cost a scan one call in `RETRY`)."""
RETRY = 8

MIN_BYTES = 8192
"""Bodies shorter than this are parsed whole and not kept: one orjson parse of a few KB costs less
than the pieces' (bench/body_parse.py's sizes by hand: 1.6 KB 2.7 vs 9.3 us, 6 KB 7.7 vs 10 us,
25 KB 27 vs 12 us)."""

ENDS = 4
"""The last items whose ends are kept: a body that changed one of them (Anthropic clients move their
cache marker to the newest message) is parsed from the end of the last one it kept."""

_WS = re.compile(rb"[ \t\n\r]*")  # JSON's whitespace (bytes.strip's also takes \x0b and \x0c)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# everything up to the next bracket or long string: runs of other bytes and whole short strings
# (escapes included; "short": the next quote within 64 bytes), in C at a few ns a byte
_SKIP = re.compile(rb'[^"\[\]{}]*(?:"(?=[^"]{0,64}")[^"\\]*(?:\\.[^"\\]*)*"[^"\[\]{}]*)*', re.DOTALL)
_SCALAR = re.compile(rb"[^,}\] \t\n\r]*")
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")


def _close(raw: bytes, pos: int, ends: list[int] | None = None) -> int:
    """The position of the bracket that closes the array or object whose contents start at `pos`;
    -1 where there is none (an unterminated string, a missing bracket). Brackets are not matched by
    kind: on valid JSON the answer is right, and on invalid JSON orjson refuses the pieces. `ends`
    gets the position after each array or object directly inside (the ends of an array's items
    that are containers). Long strings (a message's text, a tool's output) are skipped from quote
    to quote by `bytes.find` (memchr), the rest by `_SKIP`."""
    depth, skip, n = 0, _SKIP.match, len(raw)
    while True:
        pos = skip(raw, pos).end()  # type: ignore[union-attr]  # (it matches the empty string)
        if pos >= n:
            return -1
        c = raw[pos]
        if c == 0x22:  # a long string
            pos = _string_end(raw, pos) - 1
            if pos < 0:
                return -1
        elif c in _OPEN:
            depth += 1
        else:
            if not depth:
                return pos
            depth -= 1
            if not depth and ends is not None:
                ends.append(pos + 1)
        pos += 1


def _string_end(raw: bytes, pos: int) -> int:
    """The position after the string whose opening quote is at `pos` (the first quote after an even
    run of backslashes, found by `bytes.find`); 0 where it does not end."""
    find = raw.find
    while True:
        pos = find(b'"', pos + 1)
        if pos < 0:
            return 0
        back = pos - 1
        while raw[back] == 0x5C:
            back -= 1
        if not (pos - 1 - back) & 1:
            return pos + 1


def _ws(raw: bytes, pos: int) -> int:
    return _WS.match(raw, pos).end()  # type: ignore[union-attr]


def _ws_back(raw: bytes, pos: int) -> int:
    """The position after the last byte before `pos` that is not JSON whitespace (`_ws` backwards):
    where an array's last item ends, given its closing bracket."""
    while raw[pos - 1] in b" \t\n\r":
        pos -= 1
    return pos


def _locate(raw: bytes, key: str) -> tuple[int, int, list[int]] | None:
    """(the position of the `[` of top-level `key`'s array, that of its `]`, the ends of its items
    that are containers: `_close`) in `raw`, a body that orjson parsed into an object; None when
    `key` is missing, repeated, or not an array."""
    i = _ws(raw, 0) + 1  # past the "{"
    found: tuple[int, int, list[int]] | None = None
    ends: list[int] = []
    seen = 0
    i = _ws(raw, i)
    if raw[i] == 0x7D:  # "{}"
        return None
    while True:
        m = _STRING.match(raw, i)
        if m is None:
            return None
        name_bytes, i = m.group(), _ws(raw, m.end())
        name = orjson.loads(name_bytes) if b"\\" in name_bytes else name_bytes[1:-1].decode()
        i = _ws(raw, i + 1)  # past the ":"
        c = raw[i]
        if c in _OPEN:
            ends = []
            end = _close(raw, i + 1, ends)
            if end < 0:
                return None
            end += 1
        elif c == 0x22:
            end = _string_end(raw, i)
            if not end:
                return None
        else:
            end = _SCALAR.match(raw, i).end()  # type: ignore[union-attr]
        if name == key:
            seen += 1
            found = (i, end - 1, ends) if c == 0x5B else None
        i = _ws(raw, end)
        if raw[i] != 0x2C:  # the closing "}"
            break
        i = _ws(raw, i + 1)
    return found if seen == 1 else None


class BodyMemo:
    """The previous body of a session's turn route, as far as its history's last item (module doc)."""

    __slots__ = ("route", "key", "prefix", "head", "items", "ends", "misses")

    def __init__(self) -> None:
        self.route = ""  # the route whose body is kept ("" : none)
        self.key = ""  # its history field
        self.prefix = b""  # the body's bytes up to the end of its history array's last item
        self.head = b""  # the bytes before the array with `null}` after: the keys before it
        self.items: list[Any] = []  # the history items the body parsed to
        self.ends: list[tuple[int, int]] = []  # (items, where the last of them ends): `ENDS` at most
        self.misses = 0  # bodies parsed whole since the last that repeated the kept one

    def parse(self, raw: bytes, route: str, key: str) -> dict[str, Any] | None:
        """`raw` parsed as `orjson.loads` would, from the kept body and the bytes after its prefix
        (or after the end of one of its last items, for a body that changed one of those); None
        when it cannot be (not the same route, no prefix, anything unexpected): then the body is to
        be parsed whole and handed to `remember`."""
        prefix = self.prefix
        if not prefix:
            return None
        body = None
        if route == self.route and key == self.key:
            if raw.startswith(prefix):
                body = self._parse(raw, key, len(prefix), len(self.items))
            else:  # an edit in the last items (a cache marker moved on): from the last item that stayed
                view = memoryview(prefix)
                for count, end in reversed(self.ends):
                    if count < len(self.items) and raw.startswith(view[:end]):
                        body = self._parse(raw, key, end, count)
                        break
        if body is not None:
            self.misses = 0
        return body

    def _parse(self, raw: bytes, key: str, start: int, count: int) -> dict[str, Any] | None:
        """`parse` of `raw`, which repeats the kept body up to `start`, the end of its first `count`
        items."""
        n = len(raw)
        i = _ws(raw, start)
        if i >= n:
            return None
        new: list[Any] = []
        new_ends: list[int] = []
        end = start
        if raw[i] == 0x5D:  # no new items
            close = i
        else:
            if count:
                if raw[i] != 0x2C:
                    return None
                i += 1
            close = _close(raw, i, new_ends)
            if close < 0:
                return None
            try:
                new = orjson.loads(b"[" + raw[i:close] + b"]")
            except orjson.JSONDecodeError:
                return None
            # "[a,]": the new part must hold an item; and each sits two levels down in the body
            if not new or too_deep(new, MAX_JSON_DEPTH - 1):
                return None
            end = _ws_back(raw, close)
        j = _ws(raw, close + 1)
        if j >= n:
            return None
        if raw[j] == 0x7D:  # the array was the last key
            if _ws(raw, j + 1) != n:
                return None
            rest: dict[str, Any] = {}
        elif raw[j] == 0x2C:
            k = _ws(raw, j + 1)
            if k >= n or raw[k] != 0x22:  # '{"a":[],}' is no object
                return None
            try:
                rest = orjson.loads(b"{" + raw[k:])
            except orjson.JSONDecodeError:
                return None
            if key in rest or too_deep(rest):
                return None
        else:
            return None
        try:
            body = orjson.loads(self.head)
        except orjson.JSONDecodeError:  # (it parsed as part of the kept body)
            return None
        kept = self.items if count == len(self.items) else self.items[:count]
        items = [*kept, *new]
        body[key] = items
        if rest:
            body.update(rest)
        if new or kept is not self.items:
            ends = [e for e in self.ends if e[0] <= count]
            if len(new_ends) == len(new):  # every new item a container: where each ends is known
                ends += [(count + k, e) for k, e in enumerate(new_ends, 1)]
            self.prefix, self.items, self.ends = raw[:end], [*items], ends[-ENDS:]
        return body

    def remember(self, raw: bytes, route: str, key: str, body: dict[str, Any]) -> None:
        """Keeps `raw`, just parsed whole into `body`, for the next call of `route`; forgets the
        kept body instead when `raw` cannot be a next call's prefix."""
        self.misses = misses = self.misses + 1
        value = body.get(key)
        scan = misses <= MISSES or not (misses - MISSES) % RETRY
        try:
            located = _locate(raw, key) if scan and type(value) is list else None
        except IndexError:  # (not on a body orjson parsed; should one surprise it, nothing is kept)
            located = None
        if located is None:
            self.route, self.key, self.prefix, self.head, self.items, self.ends = "", "", b"", b"", [], []
            return
        start, close, ends = located
        end = _ws_back(raw, close)
        self.route, self.key = route, key
        self.prefix, self.head, self.items = raw[:end], raw[:start] + b"null}", [*value]
        # where the last items end, when every item is a container (else which is which is unknown)
        self.ends = [(k, e) for k, e in enumerate(ends, 1)][-ENDS:] if len(ends) == len(value) else []
