"""A session's last parsed history, so that a call converts only the messages it adds.

Agents send their whole conversation on every call, usually the previous call's plus the reply and
something new. A dialect's parser converts every item to the internal form and normalises it
(`renderer.normalize_more`), in Python, per item; with the session's `ParseMemo` it instead
serialises the items once (orjson, in C), and when the previous call's items are a byte-exact
prefix of this call's, reuses their normalised messages and converts only the rest. Byte-exact,
not `==`: `1 == 1.0 == True` in Python, but a template prints them differently.

Errors are unchanged: a reused prefix passed every check the last time, and the rest is converted
with its real positions, so a bad item is refused with the same message as without the memo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from palaestra.gateway.renderer import normalize_more

Convert = Callable[[list[Any], int], tuple[list[dict[str, Any]], bool]]
"""(items, position of the first) -> (internal messages, whether the last item closed a message:
False when a following item could still add to it, e.g. a Responses assistant run)."""


class ParseMemo:
    """The last call's raw history items (as JSON bytes) and the normalised messages they became."""

    __slots__ = ("_kind", "_raw", "_count", "_messages")

    def __init__(self) -> None:
        self._kind = ""
        self._raw = b""
        self._count = 0
        self._messages: list[dict[str, Any]] = []

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
