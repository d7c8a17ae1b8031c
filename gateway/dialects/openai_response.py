"""The OpenAI dialect's shaper: the core's `TurnResult` / stream events -> OpenAI answers.

Pure functions of what the core produced and what `openai_request.py` parsed; nothing here reads a
raw request or touches a tokenizer, a session or the engine. `dialect.py` describes the seam.

* `chat_completion`: a `chat.completion` object (`message` with `content`, `tool_calls`,
  `reasoning_content`; OpenAI-format `logprobs`; `usage`).
* `chat_stream`: the `chat.completion.chunk` server-sent events of a streamed call: a role chunk,
  content deltas, then reasoning, the content the holdback kept, tool calls, the finish chunk, an
  optional usage chunk with empty `choices`, and `data: [DONE]`.
* `text_completion`: a `text_completion` object for `/completions`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from palaestra.gateway.dialect import (
    StreamEvent,
    StreamFailed,
    StreamFinished,
    StreamStarted,
    TextDelta,
    TextRequest,
    TokenLogprob,
    TurnOutput,
    TurnRequest,
    TurnResult,
)
from palaestra.gateway.parsers import ToolCall
from palaestra.gateway.streaming import SSE_DONE, sse

# the core's finish -> OpenAI's finish_reason; an aborted generation (pause, abort) reads as "stop"
FINISH = {"stop": "stop", "length": "length", "abort": "stop", "tool_calls": "tool_calls"}


def finish_reason(output: TurnOutput) -> str:
    return FINISH.get(output.finish, "stop")


def usage(result: TurnResult) -> dict[str, Any]:
    completion = result.completion_tokens
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A choice's (or a delta's) `logprobs` object."""
    content = []
    for e in entries:
        content.append(
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode())} for tok, lp in e.top
                ],
            }
        )
    return {"content": content, "refusal": None}


def message(output: TurnOutput) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": output.content}
    if output.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in output.tool_calls]
    if output.reasoning is not None:
        msg["reasoning_content"] = output.reasoning
    return msg


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A stream's `delta.tool_calls`: every call whole, with its index."""
    return [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]


def chat_completion(request: TurnRequest, result: TurnResult) -> dict[str, Any]:
    choices = []
    for out in result.outputs:
        choices.append(
            {
                "index": out.index,
                "message": message(out),
                "finish_reason": finish_reason(out),
                "logprobs": chat_logprobs(out.logprobs) if out.logprobs is not None else None,
            }
        )
    return {
        "id": result.call_id,
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": choices,
        "system_fingerprint": result.weight_version,
        "usage": usage(result),
    }


class ChunkBuilder:
    """`chat.completion.chunk` events of one streamed call (id, created and model are fixed)."""

    def __init__(self, call_id: str, created: int, model: str):
        self.head = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def delta(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return sse({**self.head, "choices": [choice]})

    def usage(self, result: TurnResult) -> str:
        """The final usage chunk: `choices` is empty, as OpenAI sends it."""
        return sse({**self.head, "choices": [], "usage": usage(result)})


async def chat_stream(
    request: TurnRequest, events: AsyncGenerator[StreamEvent, None]
) -> AsyncGenerator[str, None]:
    chunks: ChunkBuilder | None = None
    async for event in events:
        if isinstance(event, StreamStarted):
            chunks = ChunkBuilder(event.call_id, event.created, event.model)
            yield chunks.delta({"role": "assistant", "content": ""})
        elif isinstance(event, TextDelta):
            assert chunks is not None
            logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
            yield chunks.delta({"content": event.text}, logprobs=logprobs)
        elif isinstance(event, StreamFailed):
            yield sse(event.error.body()) + SSE_DONE
            return
        elif isinstance(event, StreamFinished):
            # the last piece's chunks in one write (one send through the ASGI layers, one packet)
            assert chunks is not None
            out = event.result.outputs[0]
            parts: list[str] = []
            if out.reasoning is not None:
                parts.append(chunks.delta({"reasoning_content": out.reasoning}))
            if event.unsent:
                parts.append(chunks.delta({"content": event.unsent}))
            if out.tool_calls:
                parts.append(chunks.delta({"tool_calls": tool_call_deltas(out.tool_calls)}))
            parts.append(chunks.delta({}, finish_reason(out)))
            if request.params.include_usage:
                parts.append(chunks.usage(event.result))
            parts.append(SSE_DONE)
            yield "".join(parts)


def completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """Legacy completions' `logprobs`: parallel lists, `text_offset` into the choice's text."""
    tokens = [e.token for e in entries]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def text_completion(request: TextRequest, result: TurnResult) -> dict[str, Any]:
    choices = [
        {
            "index": out.index,
            "text": out.text,
            "logprobs": completion_logprobs(out.logprobs) if out.logprobs is not None else None,
            "finish_reason": finish_reason(out),
        }
        for out in result.outputs
    ]
    return {
        "id": result.call_id,
        "object": "text_completion",
        "created": result.created,
        "model": result.model,
        "choices": choices,
        "usage": usage(result),
    }
