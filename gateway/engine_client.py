"""The gateway's only way to an inference engine: SGLang's native `/generate`, token ids in and out.

`--engine-url` is sglang-router (or one engine); every call carries `X-SMG-Routing-Key: <session>`
so consistent hashing keeps a session on one worker and its prefix cache. A call is retried only
when no token can have been committed: the connection failed, or the engine answered 5xx / 503
before streaming anything. Errors become OpenAI-style 503 (unreachable) / 504 (timeout) /
400 (the engine refused the input) for the agent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson  # request bodies carry the whole prompt's ids: serialisation is on the hot path

from palaestra.gateway.errors import GatewayError

ROUTING_HEADER = "X-SMG-Routing-Key"


@dataclass
class Generation:
    """One sampled sequence as the engine returned it."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]] | None
    finish_reason: dict[str, Any]
    weight_version: str
    cached_tokens: int = 0
    weight_versions: list[dict[str, Any]] = field(default_factory=list)


def _generation(answer: dict[str, Any]) -> Generation:
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
        finish_reason=meta.get("finish_reason") or {"type": "abort", "message": "missing finish_reason"},
        weight_version=str(meta.get("weight_version", "default")),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        weight_versions=list(meta.get("weight_versions") or []),
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
    ):
        self.url = url.rstrip("/")
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.incremental_stream = incremental_stream
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            trust_env=False,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    @staticmethod
    def _headers(session_id: str) -> dict[str, str]:
        return {ROUTING_HEADER: session_id, "content-type": "application/json"}

    async def close(self) -> None:
        await self._client.aclose()

    @staticmethod
    def _body(
        input_ids: list[int], sampling: dict[str, Any], top_logprobs: int, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
        if top_logprobs:
            body["top_logprobs_num"] = top_logprobs
        if stream:
            body["stream"] = True
        return body

    def _raise_for(self, r: httpx.Response) -> None:
        try:
            detail = r.json()
            message = detail.get("message") or (detail.get("error") or {}).get("message") or r.text
        except (json.JSONDecodeError, AttributeError):
            message = r.text
        if 400 <= r.status_code < 500:
            raise GatewayError(f"the engine refused the request: {message}", 400, code="engine_rejected")
        raise GatewayError(
            f"engine error {r.status_code}: {message}", 503, type="engine_error", code="engine_unavailable"
        )

    async def generate(
        self, session_id: str, input_ids: list[int], sampling: dict[str, Any], top_logprobs: int = 0
    ) -> list[Generation]:
        """Non-streaming; returns one Generation per sample (`n` in sampling)."""
        body = self._body(input_ids, sampling, top_logprobs, stream=False)
        last: GatewayError | None = None
        for attempt in range(self.retries + 1):
            try:
                r = await self._client.post(
                    f"{self.url}/generate", content=orjson.dumps(body), headers=self._headers(session_id)
                )
            except httpx.TimeoutException:
                raise GatewayError(
                    "the engine timed out", 504, type="engine_error", code="engine_timeout"
                ) from None
            except httpx.TransportError as exc:  # nothing was generated: safe to retry
                last = GatewayError(
                    f"the engine at {self.url} is unreachable: {exc}",
                    503,
                    type="engine_error",
                    code="engine_unavailable",
                )
            else:
                if r.status_code == 200:
                    answer = orjson.loads(r.content)
                    return [_generation(a) for a in (answer if isinstance(answer, list) else [answer])]
                try:
                    self._raise_for(r)
                except GatewayError as exc:
                    if exc.status != 503:
                        raise
                    last = exc
            if attempt < self.retries:
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
        assert last is not None
        raise last

    async def stream(
        self, session_id: str, input_ids: list[int], sampling: dict[str, Any], top_logprobs: int = 0
    ) -> AsyncIterator[tuple[list[int], list[float], Generation | None]]:
        """Streams (new ids, their logprobs, final Generation or None) for one sample."""
        body = self._body(input_ids, sampling, top_logprobs, stream=True)
        last: GatewayError | None = None
        for attempt in range(self.retries + 1):
            sent = 0
            try:
                async with self._client.stream(
                    "POST",
                    f"{self.url}/generate",
                    content=orjson.dumps(body),
                    headers=self._headers(session_id),
                ) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self._raise_for(r)
                    ids: list[int] = []
                    lps: list[float] = []
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk and "meta_info" not in chunk:
                            raise GatewayError(
                                f"engine error mid-stream: {chunk['error']}", 502, type="engine_error"
                            )
                        new_ids = list(chunk.get("output_ids") or [])
                        new_lps = [
                            float(e[0]) for e in (chunk["meta_info"].get("output_token_logprobs") or [])
                        ]
                        if self.incremental_stream:
                            ids += new_ids
                            lps += new_lps
                        else:
                            ids, lps = new_ids, new_lps
                        fresh_ids, fresh_lps = ids[sent:], lps[sent:]
                        sent = len(ids)
                        final = None
                        if chunk["meta_info"].get("finish_reason") is not None:
                            final = _generation(
                                {
                                    "output_ids": ids,
                                    "meta_info": {
                                        **chunk["meta_info"],
                                        "output_token_logprobs": [
                                            [lp, t, None] for lp, t in zip(lps, ids, strict=True)
                                        ],
                                        "output_top_logprobs": None,
                                    },
                                }
                            )
                        yield fresh_ids, fresh_lps, final
                    return
            except httpx.TimeoutException:
                raise GatewayError(
                    "the engine timed out", 504, type="engine_error", code="engine_timeout"
                ) from None
            except httpx.TransportError as exc:
                if sent:  # tokens already went to the agent: never retry
                    raise GatewayError(
                        f"the engine connection broke mid-stream: {exc}", 502, type="engine_error"
                    ) from None
                last = GatewayError(
                    f"the engine at {self.url} is unreachable: {exc}",
                    503,
                    type="engine_error",
                    code="engine_unavailable",
                )
            except GatewayError as exc:
                if exc.status != 503 or sent:
                    raise
                last = exc
            if attempt < self.retries:
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
        assert last is not None
        raise last
