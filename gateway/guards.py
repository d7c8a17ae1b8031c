"""The gateway's guards against hostile and malformed input, below the dialects' own field checks.

* `BodyLimit`: a pure ASGI middleware that refuses a request body over `max_body_bytes` with 413
  before anything reads it: at once when `Content-Length` says so, and, for a chunked body, as soon
  as the bytes received pass the limit (nothing beyond the limit is kept: uvicorn pauses reading a
  socket whose unread body passes 64 KiB, and what was read is dropped with the request).
* `read_json`: the body -> a JSON object, refusing invalid UTF-8, invalid JSON, nesting deeper than
  `MAX_JSON_DEPTH` and anything but an object, each with a 400 naming the problem.
* `GuardedStream`: a streamed answer that gives up on a client that stops reading (a send that
  waits longer than `stream_send_timeout_s`), ends at once for a client that disconnects, and closes
  the call's event generator however the stream ends, so the engine request is dropped (the engine
  aborts a request whose connection closes) and the pause gate released.

Every refusal is counted in `palaestra_gateway_rejected_requests{reason}` and every stream cut
short in `palaestra_gateway_streams_cut{reason}` (docs/reliability-input.md lists them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, Callable
from typing import Any

import orjson
from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from palaestra.gateway.errors import GatewayError

log = logging.getLogger("palaestra.gateway")

MAX_JSON_DEPTH = 250
"""Deepest nesting of arrays and objects a request body may have: what orjson can write back out,
with room to spare. The gateway writes parts of a body out again (tools into the call's cache key
and into Responses answers; an Anthropic tool's schema one level deeper than it came), and orjson
reads 1024 levels but writes only 254, so a deeper body would be a 500 later. Real requests are a
dozen levels deep (a tool's JSON schema)."""
MAX_ARGUMENTS_DEPTH = 200
"""Deepest tool-call arguments the gateway parses; deeper ones stay text. Parsed arguments are
written a dozen levels down inside the session journal's and the samples' records, so they must
leave more room under orjson's 254 than a whole body does."""
_ORJSON_DEPTH = 254  # the deepest nesting orjson writes

BODY_REASONS = ("body_too_large", "invalid_utf8", "invalid_json", "nesting_too_deep", "not_an_object")
"""Reasons a body is refused before any dialect reads it (also the `code` of the error)."""
FIELD_REASONS = ("integer_above_max_value", "context_length_exceeded", "invalid_field")
"""Reasons a dialect refuses a field: an integer above its maximum (a huge `n`; `validate.number`),
`max_tokens` (or its dialect's name for it) beyond the context, any other invalid field."""
REJECT_REASONS = BODY_REASONS + FIELD_REASONS
CUT_REASONS = ("client_disconnected", "send_timeout")
"""Why a stream ended before its last event: the client closed the connection, or stopped reading."""


def too_large(limit: int, got: int | None = None) -> GatewayError:
    size = f" ({got} bytes)" if got is not None else ""
    return GatewayError(
        f"The request body{size} is larger than the gateway accepts ({limit} bytes; option max_body_bytes).",
        413,
        code="body_too_large",
    )


class BodyLimit:
    """ASGI middleware: request bodies over `max_bytes` get 413 before they are parsed (module doc).

    A `Content-Length` over the limit is answered here, in the error envelope `error_body(scope,
    exc)` gives (the app passes `routes.error_body`: the envelope of the route's dialect); a chunked
    body is counted as it arrives and the read that passes the limit raises the 413 `GatewayError`
    into the route, whose handler answers it in its dialect's envelope."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        rejected: Counter,
        error_body: Callable[[Scope, GatewayError], dict[str, Any]] = lambda scope, exc: exc.body(),
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.rejected = rejected
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        # (a length of more digits than any limit is refused without converting it)
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > self.max_bytes):
            await self._refuse(
                scope, send, too_large(self.max_bytes, int(length) if len(length) <= 18 else None)
            )
            return
        received = 0
        limit, rejected = self.max_bytes, self.rejected

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    rejected.labels(reason="body_too_large").inc()
                    raise too_large(limit)
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Scope, send: Send, exc: GatewayError) -> None:
        self.rejected.labels(reason="body_too_large").inc()
        body = orjson.dumps(self.error_body(scope, exc))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        # the unread body is not drained: closing the connection is cheaper than reading it
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def json_or_text(text: str) -> Any:
    """Tool-call arguments as the gateway keeps them: the parsed JSON (templates serialise it with
    `tojson`), or the text itself when it is not JSON or nests deeper than `MAX_ARGUMENTS_DEPTH` (too
    deep to parse, or to write into the session journal and the samples: orjson stops at 254)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    if len(text) > 2 * MAX_ARGUMENTS_DEPTH and too_deep(value, MAX_ARGUMENTS_DEPTH):
        return text
    return value


def too_deep(body: Any, depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests deeper than `depth`: orjson cannot write it inside 254 - `depth` more
    levels. Writing it costs a fraction of reading it (a Python walk over the containers costs
    several times the parse; bench/input_guards.py)."""
    probe: Any = body
    for _ in range(_ORJSON_DEPTH - depth):
        probe = [probe]
    try:
        orjson.dumps(probe)
    except TypeError:  # "Recursion limit reached"; JSONEncodeError is a TypeError too
        return True
    return False


def read_json(raw: bytes, rejected: Counter) -> dict[str, Any]:
    """A request body -> its JSON object; anything else is a counted 400 naming the problem."""
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            reason, message = "invalid_utf8", f"The request body is not valid UTF-8: {text}"
        elif "depth limit" in text or "recursion" in text.lower():
            reason = "nesting_too_deep"
            message = f"The JSON body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels."
        else:
            reason, message = "invalid_json", f"We could not parse the JSON body of your request: {text}"
        rejected.labels(reason=reason).inc()
        raise GatewayError(message, 400, code=reason) from None
    if not isinstance(body, dict):
        rejected.labels(reason="not_an_object").inc()
        raise GatewayError("The request body must be a JSON object.", 400, code="not_an_object")
    # Each level takes two bytes at least, so a shorter body cannot be too deep. (Counting its
    # brackets first would cost about as much as writing it out.)
    if len(raw) > 2 * MAX_JSON_DEPTH and too_deep(body):
        rejected.labels(reason="nesting_too_deep").inc()
        raise GatewayError(
            f"The JSON body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.",
            400,
            code="nesting_too_deep",
        )
    return body


def count_rejection(rejected: Counter, exc: GatewayError) -> None:
    """Counts a dialect's refusal of a field (a 400 after the body parsed)."""
    if exc.status == 400 and exc.code not in BODY_REASONS:
        reason = exc.code if exc.code in FIELD_REASONS else "invalid_field"
        rejected.labels(reason=reason).inc()


class _SendDeadline:
    """The deadline of a stream's send that is waiting, on one timer for the whole stream: what
    `asyncio.timeout` does per send (the task cancelled when a send waits past `timeout_s`), without a
    context and a timer per event. Marking a send costs a clock read; the timer, once armed, finds
    at its time either no send waiting (then the next send arms it), the send it was armed for still
    waiting (it cancels the task), or a later send (it waits for that one's deadline)."""

    __slots__ = ("loop", "task", "timeout_s", "deadline", "armed_for", "expired", "cancelling", "_timer")

    def __init__(self, timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # the waiting send's; None: no send waiting
        self.armed_for = 0.0
        self.expired = False
        self.cancelling = task.cancelling()  # cancellations asked before ours (`asyncio.Timeout`'s rule)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """A send begins."""
        self.deadline = when = self.loop.time() + self.timeout_s
        if self._timer is None:
            self.armed_for = when
            self._timer = self.loop.call_at(when, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.deadline is None:
            return
        if self.deadline <= self.armed_for:
            self.expired = True
            self.task.cancel()
        else:
            self.armed_for = self.deadline
            self._timer = self.loop.call_at(self.deadline, self._check)

    def timed_out(self) -> bool:
        """After a CancelledError: whether it was this deadline's alone (then it is a timeout)."""
        return self.expired and self.task.uncancel() <= self.cancelling

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class GuardedStream(Response):
    """Server-sent events that cannot pin the gateway, as a bare ASGI send loop (Starlette's
    `StreamingResponse` ran each stream in an anyio task group, and, under a server of ASGI spec 2.4,
    noticed a client that left only at its next send: a call waiting for a whole engine answer kept
    the engine generating). A send that waits longer than `send_timeout_s` (a client that stopped
    reading; the socket's buffers are full) ends the stream; a client that disconnects cancels it at
    once, whatever it waits for (a task beside it listens for `http.disconnect`); and the event
    generator is closed however the stream ends, which drops the engine request (the engine aborts a
    request whose connection closes) and releases the pause gate. Ends cut short are counted by
    `CUT_REASONS`. A `Response` for FastAPI's sake (it returns a route's `Response` as it is)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterable[str], *, send_timeout_s: float, cut: Counter):
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self.send_timeout_s = send_timeout_s
        self.cut = cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = _ClientLeft()
        listener = asyncio.ensure_future(left.listen(receive))
        try:
            await self.stream_response(send, left)
        finally:
            left.active = False
            listener.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send, left: _ClientLeft) -> None:
        finished = False
        deadline = _SendDeadline(self.send_timeout_s)
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                body = chunk.encode() if isinstance(chunk, str) else chunk
                if not await self._send_in_time(send, deadline, body, True):
                    return
            finished = True
            # a shaper may end before the core's events do (`streaming.ShapedStream` closes both)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            # the answer is whole: the server reports a disconnect once the last message goes out.
            # That message waits for room too (uvicorn drains before each write): a client that
            # stopped reading just before it would otherwise hold the connection for good.
            left.active = False
            await self._send_in_time(send, deadline, b"", False)
        except (asyncio.CancelledError, OSError):  # the client went away
            left.active = False  # (before any await: no second cancellation from the listener)
            self.cut.labels(reason="client_disconnected").inc()
            if not left.gone():
                raise
            # the listener's cancellation alone: the client left, nothing is left to answer
        finally:
            left.active = False
            deadline.close()
            if not finished:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def _send_in_time(self, send: Send, deadline: _SendDeadline, body: bytes, more: bool) -> bool:
        """One body message, within the send deadline: False when it timed out (then counted, and
        the caller returns: ending without the last body message makes uvicorn close the connection)."""
        deadline.start()
        try:
            await send({"type": "http.response.body", "body": body, "more_body": more})
        except asyncio.CancelledError:
            if not deadline.timed_out():
                raise
            self.cut.labels(reason="send_timeout").inc()
            log.warning("a client read nothing for %.0f s: its stream was ended", self.send_timeout_s)
            return False
        deadline.deadline = None
        return True


class _ClientLeft:
    """Cancels a stream's task when its client disconnects (`GuardedStream`): `listen` runs beside the
    stream while `active`; `gone()`, after a CancelledError, says whether it was this cancellation
    alone (`asyncio.Timeout`'s rule: the task's other cancellation requests stay)."""

    __slots__ = ("task", "cancelling", "cancelled", "active")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()
        self.cancelled = False
        self.active = True

    async def listen(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server whose receive fails: then only a failed send notices a client gone
            return
        if self.active:
            self.cancelled = True
            self.task.cancel()

    def gone(self) -> bool:
        return self.cancelled and self.task.uncancel() <= self.cancelling
