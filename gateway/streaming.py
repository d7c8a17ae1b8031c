"""Streaming machinery shared by every dialect: what text may go out yet, and SSE framing.

The core (`service.GatewayService`) streams a turn as `dialect.StreamEvent`s; a dialect's shaper
turns them into its server-sent events. This module holds what neither side is about:

* `HeldBackText`: the decoded text of a growing list of token ids, minus what cannot be sent yet
  (a partial UTF-8 character, the start of tool-call markup, a possible stop string),
  so an agent never receives text that the final parse would have to take back;
* `sse` / `sse_json` / `SSE_DONE`: one event's wire text (from an object, or from its JSON);
* `ShapedStream`: runs a shaper over the core's events so that closing the response closes both
  (a client that goes away releases the pause gate at once, not when the generator is collected).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from palaestra.gateway.dialect import StreamEvent

SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; `event` names it (Anthropic and the Responses API name theirs)."""
    return sse_json(json.dumps(data, ensure_ascii=False), event)


def sse_json(data: str, event: str | None = None) -> str:
    """`sse` of data already in JSON."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n"


MAX_STOP_CHARS = 256
"""Longest stop string a request may set. Every streamed token checks whether the text ends with a
beginning of each stop string, so their length is work per token on the event loop that serves every
session: unbounded, 16 stop strings of 20,000 characters held it ~200 ms per token."""


def safe_prefix(text: str, markers: list[str], stops: list[str]) -> str:
    """The part of streamed text that can go out now: not a partial UTF-8 char, markup or stop string."""
    return text[: _cut(text, markers, stops)[0]]


def _cut(text: str, markers: list[str], stops: list[str]) -> tuple[int, bool]:
    """Where `safe_prefix` cuts `text`, and whether that is where a held string occurs whole before
    the text's trailing replacement characters (then no text appended later moves the cut)."""
    cut = len(text)
    while cut and text[cut - 1] == "\ufffd":
        cut -= 1
    stable, found = cut, cut + 1
    for held in (markers, stops):
        for s in held:
            pos = text.find(s)
            if pos >= 0:
                cut = min(cut, pos)
                if pos + len(s) <= stable:
                    found = min(found, pos)
            if not cut:
                break
            # It may be arriving: the longest beginning s[:k] the text ends with. Only the k whose
            # last character is the text's last one can match (found with rfind, in C).
            last = text[cut - 1]
            j = s.rfind(last, 0, min(len(s) - 1, cut))
            while j >= 0:
                if text.endswith(s[: j + 1], 0, cut):
                    cut -= j + 1
                    break
                j = s.rfind(last, 0, j)
    return cut, cut == found


class HeldBackText:
    """Text of a stream's ids so far, handed out only as far as `safe_prefix` allows.

    With `concatenates` (the decoder's text of ids[:p] + ids[p:] is that of ids wherever the first
    part's text ends on a whole character: byte-level BPE, `ChatRenderer.decode_concatenates`), each
    piece costs what it adds, not the answer so far: only the ids past the last whole character
    are decoded, and the held strings are looked for only in the text not sent yet plus the longest
    held string's length before it (where one may have begun). Once a held string occurs whole where
    the text is cut, nothing after it can go out, and later pieces cost nothing. Without it, every
    piece decodes all ids (a decoder that strips or joins spaces may change earlier text).
    tests/gateway/test_streaming.py checks both give the text the plain definition gives."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        markers: list[str],
        stops: list[str],
        hold_space: bool = False,
        concatenates: bool = False,
    ):
        self.decode = decode
        self.markers = [m for m in markers if m]
        self.stops = stops
        self.hold_space = hold_space
        """Hold back trailing whitespace: with tools on, content before a call is stripped at the end."""
        self.concatenates = concatenates
        self.sent = ""
        self._reach = max(map(len, self.markers + self.stops), default=0)
        self._ids = 0  # ids whose text is settled: it ends on a whole character
        self._base = 0  # where in the whole text `_text` starts (never after len(sent) - _reach)
        self._text = ""  # the settled text from `_base` on
        self._closed = False  # a held string cut the text for good

    def advance(self, ids: list[int]) -> str:
        """The new text that can go out, given all ids so far ('' when nothing may be sent yet)."""
        if self._closed:
            return ""
        if not self.concatenates:
            safe = safe_prefix(self.decode(ids), self.markers, self.stops)
            if self.hold_space:
                safe = safe.rstrip()
            if len(safe) > len(self.sent) and safe.startswith(self.sent):
                delta, self.sent = safe[len(self.sent) :], safe
                return delta
            return ""
        tail = self.decode(ids[self._ids :]) if len(ids) > self._ids else ""
        window = self._text + tail  # the text from `_base` on
        if tail and tail[-1] != "\ufffd":
            self._text, self._ids = window, len(ids)
        cut, closed = _cut(window, self.markers, self.stops)
        safe = window[:cut].rstrip() if self.hold_space else window[:cut]
        base, sent = self._base, self.sent
        delta = ""
        if self._base + len(safe) > len(sent) and safe.startswith(sent[base:]):
            delta = safe[len(sent) - base :]
            self.sent = sent = sent + delta
            start = min(len(sent) - self._reach, base + len(self._text))
            if start > base:
                self._text, self._base = self._text[start - base :], start
        self._closed = closed and len(sent) >= base + len(safe)
        return delta

    def unsent(self, content: str) -> str:
        """What of the final content still has to go out: what was sent cannot be taken back, so
        only text that extends it is sent."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


class ShapedStream:
    """A shaper's chunks over the core's events, so that closing the response closes both (a client
    that goes away releases the pause gate at once, not when the generator is collected). Not a
    generator of its own: each chunk comes straight from the shaper's, one layer less per event."""

    def __init__(
        self,
        events: AsyncGenerator[StreamEvent, None],
        shape: Callable[[AsyncGenerator[StreamEvent, None]], AsyncGenerator[str, None]],
    ) -> None:
        self.events = events
        self.chunks = shape(events)

    def __aiter__(self) -> ShapedStream:
        return self

    def __anext__(self) -> Awaitable[str]:
        return self.chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            await self.events.aclose()
