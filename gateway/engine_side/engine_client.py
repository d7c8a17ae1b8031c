"""The gateway's only way to an inference engine: SGLang's native `/generate`, token ids in and out.

`--engine-url` is sglang-router (or one engine); every call carries `X-SMG-Routing-Key: <session>`
so consistent hashing keeps a session on one worker and its prefix cache, or, given a
`routing.CallRoute`, that route's headers (the placement layer's `X-SMG-Target-Worker` too; a 503
from the router then re-places the call before the retry); when the policy is a LoRA adapter
(`lora_adapter`), ``lora_path: <adapter>`` (SGLang's field); with `routed_experts` (the model's layers and
top_k), ``return_routed_experts: true`` and ``routed_experts_start_len``, the first position whose
routing the call needs (`RoutedExperts`: an engine that leaves the field out is refused, naming the flag). A call is retried only
when no token can have been committed: the connection failed, or the engine answered 5xx / 503
before streaming anything. Errors become OpenAI-style 503 (unreachable) / 504 (timeout) /
400 (the engine refused the input) for the agent.

The HTTP client is `gateway.engine_http`'s (`engine_http.py`): by default a bare keep-alive HTTP/1.1
client (an asyncio protocol per connection and httptools' parser), which costs less per call than
aiohttp's, the cheapest general client measured before it (httpx's async client cost ~2.5x
aiohttp's); aiohttp's stays behind the switch (`engine_http: aiohttp`). Measured: docs/gateway.md,
"(issue 39, point 1, fifth part: the engine client)". Either opens its connections on first use,
inside the serving event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson  # request bodies carry the whole prompt's ids: serialisation is on the hot path

from palaestra.gateway.engine_side.encoded_ids import EncodedIds
from palaestra.gateway.engine_side.engine_http import (
    AiohttpHttp,
    BareHttp,
    ConnectionTimeoutError,
    EngineConnectionError,
    open_http,
)
from palaestra.gateway.engine_side.generation import (
    FinishReason,
    Generation,
    RoutedExperts,
    SamplingParams,
    VersionSpan,
)
from palaestra.gateway.engine_side.placement import ROUTING_HEADER
from palaestra.gateway.errors import GatewayError

if TYPE_CHECKING:
    from palaestra.gateway.engine_side.routing import CallRoute


def _refused_target(status: int, raw: bytes) -> bool:
    """sglang-router's answers when the X-SMG-Target-Worker it was given cannot take the call and
    nothing was generated: 503 `no_available_workers` (no such healthy worker) or 500
    `call_upstream_request_error` (the worker died before the router's health check noticed)."""
    return (status == 503 and b"no_available_workers" in raw) or (
        status == 500 and b"call_upstream_request_error" in raw
    )


ROUTING_FLAG_HINT = (
    "start the engines with --enable-return-routed-experts, or set trainer.routing_replay: off"
)


@dataclass(frozen=True)
class RoutingAsk:
    """What one call asks of the routed experts: from position `start`, rows of `layers` x `top_k`."""

    start: int
    layers: int
    top_k: int

    def read(self, meta: dict[str, Any]) -> RoutedExperts:
        data = meta.get("routed_experts")
        if data is None:
            raise GatewayError(
                f"the engine answered without meta_info.routed_experts: {ROUTING_FLAG_HINT}",
                502,
                type="engine_error",
                code="routing_unavailable",
            )
        try:
            return RoutedExperts.from_wire(data, self.start, self.layers, self.top_k)
        except ValueError as exc:
            raise GatewayError(f"the engine's {exc}", 502, type="engine_error") from None


def _generation(answer: dict[str, Any], routing: RoutingAsk | None = None) -> Generation:
    meta = answer.get("meta_info") or {}
    lps = meta.get("output_token_logprobs") or []
    ids = list(answer.get("output_ids") or [])
    if len(lps) != len(ids):
        raise GatewayError(
            f"engine returned {len(ids)} output ids but {len(lps)} logprobs", 502, type="engine_error"
        )
    tops = meta.get("output_top_logprobs")
    return Generation(
        output_ids=ids,
        logprobs=[float(e[0]) for e in lps],
        top_logprobs=[[(float(t[0]), int(t[1])) for t in (row or [])] for row in tops] if tops else None,
        finish_reason=FinishReason.of(meta.get("finish_reason")),
        weight_version=str(meta.get("weight_version", "default")),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        weight_versions=[VersionSpan.of(s) for s in meta.get("weight_versions") or []],
        routed=routing.read(meta) if routing is not None else None,
    )


class EngineClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 2,
        retry_backoff_s: float = 0.5,
        incremental_stream: bool = False,
        max_connections: int = 512,
        connect_timeout_s: float = 10.0,
        lora_adapter: str | None = None,
        routed_experts: tuple[int, int] | None = None,
        engine_http: str = "bare",
    ):
        self.url = url.rstrip("/")
        self.routed_experts = routed_experts  # (layers, top_k): every call asks its routed experts
        self.lora_adapter = lora_adapter
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.incremental_stream = incremental_stream
        # `connect_timeout_s` counts from the socket's connect, not a wait for a free connection: a
        # connection not made in it sent nothing, so it is retried like a refused one. A bad
        # `engine_http` is refused here, at start, in one line naming the option.
        self.http: BareHttp | AiohttpHttp = open_http(
            engine_http,
            self.url,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
        )
        self.encoded_ids = EncodedIds()  # each session's last prompt ids as JSON, for the next call

    def _target(self, route: CallRoute | None) -> str:
        """Where the call is posted: the router (or the one engine), or the placed worker itself when
        calls bypass the router (routing replay: `RoutingOptions.direct`)."""
        url = route.url if route is not None else None
        return f"{url.rstrip('/') if url else self.url}/generate"

    @staticmethod
    def _headers(session_id: str, route: CallRoute | None) -> dict[str, str]:
        call_headers = route.call_headers() if route is not None else {ROUTING_HEADER: session_id}
        return {**call_headers, "content-type": "application/json"}

    async def close(self) -> None:
        await self.http.close()

    def _ask(self, routed_from: int) -> RoutingAsk | None:
        if self.routed_experts is None:
            return None
        return RoutingAsk(routed_from, *self.routed_experts)

    def _body(
        self,
        session_id: str,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int,
        stream: bool,
        routing: RoutingAsk | None = None,
    ) -> list[bytes | memoryview]:
        """The /generate body in pieces, whose join is `orjson.dumps` of {"input_ids": ..., the rest}
        byte for byte, the ids' JSON reusing the session's previous prompt's (`EncodedIds`). Not
        joined here: the bare client writes the pieces as they are (one `writev`), aiohttp's joins."""
        body: dict[str, Any] = {
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
        }
        if self.lora_adapter is not None:
            body["lora_path"] = self.lora_adapter
        if top_logprobs:
            body["top_logprobs_num"] = top_logprobs
        if stream:
            body["stream"] = True
        if routing is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routing.start
        ids = self.encoded_ids.pieces(session_id, input_ids)
        return [b'{"input_ids":', *ids, b",", memoryview(orjson.dumps(body))[1:]]

    def _raise_for(self, status: int, raw: bytes) -> None:
        text = raw.decode(errors="replace")
        try:
            detail = orjson.loads(raw)
            message = detail.get("message") or (detail.get("error") or {}).get("message") or text
        except (orjson.JSONDecodeError, AttributeError):
            message = text
        if 400 <= status < 500:
            if self.routed_experts is not None and "routed_experts" in message:
                message = f"{message} ({ROUTING_FLAG_HINT})"
            raise GatewayError(f"the engine refused the request: {message}", 400, code="engine_rejected")
        raise GatewayError(
            f"engine error {status}: {message}", 503, type="engine_error", code="engine_unavailable"
        )

    def _unreachable(self, exc: Exception) -> GatewayError:
        return GatewayError(
            f"the engine at {self.url} is unreachable: {exc!r}",
            503,
            type="engine_error",
            code="engine_unavailable",
        )

    async def generate(
        self,
        session_id: str,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int = 0,
        route: CallRoute | None = None,
        routed_from: int = 0,
    ) -> list[Generation]:
        """Non-streaming; returns one Generation per sample (`n` in sampling). `routed_from`: the
        first position whose routed experts the call asks (with `routed_experts`)."""
        routing = self._ask(routed_from)
        body = self._body(session_id, input_ids, sampling, top_logprobs, False, routing)
        last: GatewayError | None = None
        for attempt in range(self.retries + 1):
            try:
                async with self.http.post(self._target(route), body, self._headers(session_id, route)) as r:
                    raw = await r.read()
                    status = r.status
            except ConnectionTimeoutError as exc:  # no connection: nothing sent, safe to retry
                last = self._unreachable(exc)
                if await _replace_direct(route):
                    continue
            except TimeoutError:  # the call's total timeout
                raise GatewayError(
                    "the engine timed out", 504, type="engine_error", code="engine_timeout"
                ) from None
            except EngineConnectionError as exc:  # nothing was generated: safe to retry
                last = self._unreachable(exc)
                if await _replace_direct(route):
                    continue
            else:
                if status == 200:
                    answer = orjson.loads(raw)
                    answers = answer if isinstance(answer, list) else [answer]
                    return [_generation(a, routing) for a in answers]
                try:
                    self._raise_for(status, raw)
                except GatewayError as exc:
                    if exc.status != 503:
                        raise
                    last = exc
                    reason = "refused" if _refused_target(status, raw) else "engine_error"
                    if route is not None and await route.retry(reason):
                        continue  # the router refused the target, or its engine failed: try elsewhere
            if attempt < self.retries:
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
        assert last is not None
        raise last

    async def stream(
        self,
        session_id: str,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        top_logprobs: int = 0,
        route: CallRoute | None = None,
        routed_from: int = 0,
    ) -> AsyncIterator[tuple[list[int], list[float], Generation | None]]:
        """Streams (new ids, their logprobs, final Generation or None) for one sample. Attempts are
        retried as `generate`'s are while nothing was streamed; once a token went out, never."""
        routing = self._ask(routed_from)
        body = self._body(session_id, input_ids, sampling, top_logprobs, True, routing)
        last: GatewayError | None = None
        for attempt in range(self.retries + 1):
            progress = _Progress()
            try:
                attempt_pieces = self._stream_attempt(session_id, body, route, progress, routing)
                async with contextlib.aclosing(attempt_pieces):  # a client gone: the answer is closed now
                    async for piece in attempt_pieces:
                        yield piece
            except ConnectionTimeoutError as exc:  # no connection: nothing sent, safe to retry
                last = self._unreachable(exc)
                if await _replace_direct(route):
                    continue
            except TimeoutError:
                raise GatewayError(
                    "the engine timed out", 504, type="engine_error", code="engine_timeout"
                ) from None
            except EngineConnectionError as exc:
                if progress.sent:  # tokens already went to the agent: never retry
                    raise GatewayError(
                        f"the engine connection broke mid-stream: {exc!r}", 502, type="engine_error"
                    ) from None
                last = self._unreachable(exc)
                if await _replace_direct(route):
                    continue
            except GatewayError as exc:
                if exc.status != 503 or progress.sent:
                    raise
                last = exc
            else:
                if progress.refused is None:
                    return
                last = progress.refused
                continue  # refused target, nothing streamed: the next attempt goes elsewhere at once
            if attempt < self.retries:
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
        assert last is not None
        raise last

    async def _stream_attempt(
        self,
        session_id: str,
        body: list[bytes | memoryview],
        route: CallRoute | None,
        progress: _Progress,
        routing: RoutingAsk | None = None,
    ) -> AsyncIterator[tuple[list[int], list[float], Generation | None]]:
        """One POST of a streamed call, its pieces as they come; `progress` counts the ids that went
        out, or holds the error when the router refused the target (then nothing was streamed)."""
        async with self.http.post(self._target(route), body, self._headers(session_id, route)) as r:
            if r.status != 200:
                raw = await r.read()
                refused = _refused_target(r.status, raw)
                if route is not None and (refused or r.status >= 500):
                    # nothing streamed: the router refused the target, or its engine failed the call
                    error = self._unreachable(RuntimeError(raw.decode(errors="replace")))
                    if await route.retry("refused" if refused else "engine_error"):
                        progress.refused = error
                        return
                self._raise_for(r.status, raw)
            sample = _StreamedSample(self.incremental_stream, routing)
            head = b""  # the answer's first bytes, for the error when it is not an event stream
            # The complete lines of each read go on as one piece: each piece costs a pass through the
            # turn core and the dialect's stream, and a busy engine's chunks arrive in bunches. One
            # loop from the socket's reads to the pieces; lines of any length (cumulative chunks of a
            # long generation outgrow aiohttp's own readline limit).
            buffer = b""  # a line not complete yet
            done = False
            while not done:
                data = await r.read_some()
                if data is None:  # the body ended: what is left is its last line
                    lines, buffer, done = [buffer] if buffer else [], b"", True
                else:
                    *lines, buffer = (buffer + data).split(b"\n")
                events = []
                for line in lines:
                    if len(head) < 200:
                        head += line[:200] + b"\n"
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        r.ended()  # its connection may go back to the pool once the body's framing ends
                        break
                    events.append(data)
                if events:
                    piece = sample.add(events)
                    progress.sent = sample.sent
                    yield piece
            if not sample.finished:
                kind = r.headers.get("content-type", "no content-type")
                raise GatewayError(
                    "the engine's streaming /generate answer ended without a final chunk "
                    f"(SGLang's event stream has one with meta_info.finish_reason); it sent {kind}: "
                    f"{head[:200].decode(errors='replace')!r}",
                    502,
                    type="engine_error",
                )


async def _replace_direct(route: CallRoute | None) -> bool:
    """A call posted to a worker directly could not connect (nothing was sent): the worker is
    quarantined and the call re-placed on another one (True); False when calls go through the router."""
    return route is not None and route.url is not None and await route.retry("unreachable")


@dataclass
class _Progress:
    """What one streamed attempt got to: ids sent on, or the router's refusal of its target."""

    sent: int = 0
    refused: GatewayError | None = None


def _chunk(data: bytes) -> dict[str, Any]:
    """One event of SGLang's stream, checked: an error event or a chunk that is not SGLang's is a 502."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        chunk = None
    if isinstance(chunk, dict) and "error" in chunk and "meta_info" not in chunk:
        raise GatewayError(f"engine error mid-stream: {chunk['error']}", 502, type="engine_error")
    if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
        raise GatewayError(
            f"the engine sent a stream chunk that is not SGLang's: {data[:200]!r}", 502, type="engine_error"
        )
    return chunk


class _StreamedSample:
    """One streamed sample's ids and logprobs so far, from SGLang's chunks: each the whole output so
    far (the default) or only the new part (`incremental`: --incremental-streaming-output)."""

    def __init__(self, incremental: bool, routing: RoutingAsk | None = None) -> None:
        self.incremental = incremental
        self.routing = routing
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.sent = 0  # ids already handed on
        self.finished = False

    def add(self, events: list[bytes]) -> tuple[list[int], list[float], Generation | None]:
        """The new ids and logprobs of consecutive events (their `data`), and the whole Generation
        when the last is the final chunk. A cumulative chunk holds every one before it, so only the
        last of those is read; only the logprobs not yet known are converted (a chunk repeats all)."""
        chunk: dict[str, Any] = {}
        for data in events if self.incremental else events[-1:]:
            chunk = _chunk(data)
            entries = chunk["meta_info"].get("output_token_logprobs") or []
            if self.incremental:
                self.ids += chunk.get("output_ids") or []
                self.lps += [float(e[0]) for e in entries]
            else:
                self.ids = list(chunk.get("output_ids") or [])
                del self.lps[len(entries) :]
                self.lps += [float(e[0]) for e in entries[len(self.lps) :]]
        meta = chunk["meta_info"]
        fresh_ids, fresh_lps = self.ids[self.sent :], self.lps[self.sent :]
        self.sent = len(self.ids)
        if meta.get("finish_reason") is None:
            return fresh_ids, fresh_lps, None
        self.finished = True
        logprobs = [[lp, t, None] for lp, t in zip(self.lps, self.ids, strict=True)]
        final = _generation(
            {
                "output_ids": self.ids,
                "meta_info": {**meta, "output_token_logprobs": logprobs, "output_top_logprobs": None},
            },
            self.routing,
        )
        return fresh_ids, fresh_lps, final
