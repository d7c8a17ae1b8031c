"""A session's last parsed history, so that a call converts only the messages it adds.

Agents send their whole conversation on every call, usually the previous call's plus the reply and
something new. A dialect's parser converts every item to the internal form and normalises it
(`renderer.normalize_more`), in Python, per item; with the session's `ParseMemo` it instead
serialises the items once (orjson, in C), and when the previous call's items are a byte-exact
prefix of this call's, reuses their normalised messages and converts only the rest. Byte-exact,
not `==`: `1 == 1.0 == True` in Python, but a template prints them differently.

Errors are unchanged: a reused prefix passed every check the last time, and the rest is converted
with its real positions, so a bad item is refused with the same message as without the memo.

Agents also send the same tools on every call (Claude Code's and Codex's: 30-50 KB of schemas): the
memo keeps the last call's converted tools while their JSON is the same byte for byte (`tools`),
and the tools' part of the call's context key written once per tools list (`context`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from palaestra.gateway.renderer import normalize_more

Convert = Callable[[list[Any], int], tuple[list[dict[str, Any]], bool]]
"""(items, position of the first) -> (internal messages, whether the last item closed a message:
False when a following item could still add to it, e.g. a Responses assistant run)."""


T = TypeVar("T")


class ParseMemo:
    """The last call's raw history items (as JSON bytes) and the normalised messages they became;
    its raw tools and what they became."""

    __slots__ = ("_kind", "_raw", "_count", "_messages", "_tools_kind", "_tools_raw", "_tools", "_context")

    def __init__(self) -> None:
        self._kind = ""
        self._raw = b""
        self._count = 0
        self._messages: list[dict[str, Any]] = []
        self._tools_kind = ""
        self._tools_raw = b""
        self._tools: Any = None
        self._context: tuple[Any, bytes] = (None, b"null")  # a tools list, its JSON (keys sorted)

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
        try:
            raw: bytes | None = orjson.dumps(items)
        except (TypeError, orjson.JSONEncodeError):  # not from a JSON body: no reuse
            raw = None
        start, known = 0, self._messages
        if raw is not None and self._count and kind == self._kind:
            prev = self._raw
            # "[a,b]" repeats "[a" + "," ...: the first items are exactly the previous call's
            if raw == prev or (
                len(raw) > len(prev) and raw[len(prev) - 1] == 44 and raw.startswith(prev[:-1])
            ):
                start = self._count
        new, closed = convert(items[start:], start)
        messages = (known if start else []) + normalize_more(new, offset + (len(known) if start else 0))
        if raw is not None and closed:
            self._kind, self._raw, self._count, self._messages = kind, raw, len(items), messages
        else:
            self._count = 0
        return [*messages]  # the caller's own list: the request's messages are edited in place
