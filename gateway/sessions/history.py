"""A session's last parsed history, so that a call converts only the messages it adds.

Agents send their whole conversation on every call, usually the previous call's plus the reply and
something new. A dialect's parser converts every item to the internal form and normalises it
(`renderer.normalize_more`), in Python, per item; with the session's `ParseMemo` it instead
serialises the items once (orjson, in C), and when the previous call's items are a byte-exact
prefix of this call's, reuses their normalised messages and converts only the rest. Byte-exact,
not `==`: `1 == 1.0 == True` in Python, but a template prints them differently.

Errors are unchanged: a reused prefix passed every check the last time, and the rest is converted
with its real positions, so a bad item is refused with the same message as without the memo.

The body itself is parsed incrementally too (`read_body`, gateway/sessions/body_memo.py): its
history items are then the previous call's objects plus new ones, and a list of items handed out so
is trusted: while its first items are the very objects the last call remembered (nothing edits
parsed items in place), they are the same JSON without writing the whole history out again.

Agents also send the same tools on every call (Claude Code's and Codex's: 30-50 KB of schemas): the
memo keeps the last call's converted tools while their JSON is the same byte for byte (`tools`),
and the tools' part of the call's context key written once per tools list (`context`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from prometheus_client import Counter

from palaestra.gateway.guards import read_json
from palaestra.gateway.renderer import normalize_more
from palaestra.gateway.sessions.body_memo import MIN_BYTES, BodyMemo

Convert = Callable[[list[Any], int], tuple[list[dict[str, Any]], bool]]
"""(items, position of the first) -> (internal messages, whether the last item closed a message:
False when a following item could still add to it, e.g. a Responses assistant run)."""


T = TypeVar("T")


class ParseMemo:
    """The last call's raw history items (as JSON bytes, or the trusted items themselves) and the
    normalised messages they became; its raw tools and what they became; its body (`read_body`)."""

    __slots__ = (
        "_kind",
        "_raw",
        "_items",
        "_count",
        "_messages",
        "_tools_kind",
        "_tools_raw",
        "_tools",
        "_context",
        "_body",
        "_trusted",
    )

    def __init__(self) -> None:
        self._kind = ""
        self._raw: bytes | None = b""  # None: not written yet (then `_items` has them)
        self._items: list[Any] | None = None  # the items themselves, when they were trusted
        self._count = 0
        self._messages: list[dict[str, Any]] = []
        self._tools_kind = ""
        self._tools_raw = b""
        self._tools: Any = None
        self._context: tuple[Any, bytes] = (None, b"null")  # a tools list, its JSON (keys sorted)
        self._body = BodyMemo()
        self._trusted: list[Any] | None = None  # the items list of the last body `read_body` read

    def read_body(self, raw: bytes, route: str, key: str, rejected: Counter) -> dict[str, Any]:
        """`guards.read_json(raw, rejected)` (the same body, the same refusals) for a call of the turn
        route `route` whose history is the field `key`, parsing only what `raw` adds to the last
        body of the same route (gateway/sessions/body_memo.py). Its history list is trusted by
        `history`: its items are parsed JSON that nothing changes."""
        if len(raw) < MIN_BYTES:  # parsed whole, cheaper than in pieces; nothing kept
            self._trusted = None
            if self._body.prefix:
                self._body = BodyMemo()
            return read_json(raw, rejected)
        body = self._body.parse(raw, route, key)
        if body is None:
            self._trusted = None
            body = read_json(raw, rejected)
            self._body.remember(raw, route, key, body)
        items = body.get(key)
        self._trusted = items if type(items) is list else None
        return body

    def tools(self, kind: str, raw: Any, convert: Callable[[Any], T]) -> T:
        """`convert(raw)`, or what it returned for the last call of the same `kind` when `raw` is the
        same JSON byte for byte (the same object back: nothing may change it). A `raw` that `convert`
        refuses raises as it would without the memo, and is not kept."""
        try:
            key: bytes | None = orjson.dumps(raw)
        except (TypeError, orjson.JSONEncodeError):  # not from a JSON body: no reuse
            key = None
        if key is not None and key == self._tools_raw and kind == self._tools_kind:
            return self._tools
        out = convert(raw)
        if key is not None:
            self._tools_kind, self._tools_raw, self._tools = kind, key, out
        return out

    def context(self, tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None) -> bytes:
        """`orjson.dumps([tools, template_kwargs], option=OPT_SORT_KEYS)` (what a turn records as the
        template's input besides the messages), the tools written once while the same list comes
        back from `tools`."""
        known, written = self._context
        if tools is not known:
            written = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)
            self._context = (tools, written)
        return b"[" + written + b"," + orjson.dumps(template_kwargs, option=orjson.OPT_SORT_KEYS) + b"]"

    def history(self, kind: str, items: list[Any], convert: Convert, offset: int) -> list[dict[str, Any]]:
        """`normalize_more(convert(items, 0)[0], offset)`, reusing the previous call's work on the items
        it repeats. `kind` names the dialect (a session may mix them); `offset`: the messages that
        go before these (errors count them)."""
        trusted = items is self._trusted
        self._trusted = None
        start, known, count, raw = 0, self._messages, self._count, None
        if (
            trusted
            and count
            and self._items is not None
            and kind == self._kind
            and len(items) >= count
            and all(map(operator.is_, items, self._items))
        ):
            start = count  # the very items the last call kept, unchanged: the same JSON
        else:
            try:
                raw = orjson.dumps(items)
            except (TypeError, orjson.JSONEncodeError):  # not from a JSON body: no reuse
                raw = None
            if raw is not None and count and kind == self._kind:
                prev = self._raw if self._raw is not None else orjson.dumps(self._items)
                # "[a,b]" repeats "[a" + "," ...: the first items are exactly the previous call's
                if raw == prev or (
                    len(raw) > len(prev) and raw[len(prev) - 1] == 44 and raw.startswith(prev[:-1])
                ):
                    start = count
        new, closed = convert(items[start:], start)
        messages = (known if start else []) + normalize_more(new, offset + (len(known) if start else 0))
        if closed and (trusted or raw is not None):
            self._kind, self._count, self._messages = kind, len(items), messages
            # trusted items are kept themselves (written out only if a later call needs their JSON)
            self._raw, self._items = raw, ([*items] if trusted else None)
        else:
            self._count = 0
        return [*messages]  # the caller's own list: the request's messages are edited in place
