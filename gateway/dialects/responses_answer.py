"""The OpenAI Responses API dialect: the shapers (`responses_api.py` is the parser).

`answer` shapes the core's `TurnResult` into a `response` object: output items reasoning, message,
tool calls -- the order `responses_api.parse` folds back into one assistant message. A call of a
namespace's tool is a `function_call` with its `namespace`; a call of a custom tool a
`custom_tool_call` (`input`); with `include: ["reasoning.encrypted_content"]` the reasoning item
also carries the reasoning sealed in `encrypted_content` (`sealed.py`).

Stream events, in order: `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its content events (`response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`;
`response.reasoning_text.delta` / `.done` for reasoning; `response.function_call_arguments.delta`
/ `.done` for calls, `response.custom_tool_call_input.delta` / `.done` for custom tool calls),
`response.output_item.done`, and last `response.completed` (or
`response.incomplete` when cut by `max_output_tokens`, `response.failed` when the engine failed).
Content streams as it is sampled; reasoning and calls are parsed whole and arrive at the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from palaestra.gateway.dialect import (
    StreamEvent,
    StreamFailed,
    StreamFinished,
    StreamStarted,
    TextDelta,
    TokenLogprob,
    TurnOutput,
    TurnRequest,
    TurnResult,
)
from palaestra.gateway.dialects.sealed import seal
from palaestra.gateway.streaming import sse, sse_json


def _logprobs(entries: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top],
        }
        for e in entries or []
    ]


def _ids(call_id: str) -> str:
    return call_id.removeprefix("resp_")


def _reasoning_item(call_id: str, text: str, sealed: bool) -> dict[str, Any]:
    """A reasoning item; `sealed` (include reasoning.encrypted_content): with the reasoning sealed
    in `encrypted_content`, which the parser restores when the client sends only that back."""
    item: dict[str, Any] = {"type": "reasoning", "id": f"rs_{_ids(call_id)}", "summary": []}
    item["content"] = [{"type": "reasoning_text", "text": text}]
    if sealed:
        item["encrypted_content"] = seal(text)
    return {**item, "status": "completed"}


def _message_item(call_id: str, text: str, logprobs: Any, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    content = [part] if status == "completed" else []
    return {
        "type": "message",
        "id": f"msg_{_ids(call_id)}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(request: TurnRequest, call_id: str, j: int, call: Any) -> dict[str, Any]:
    """A `function_call` item, or for a custom tool a `custom_tool_call` (`input`: the one string
    argument it was rendered with); a namespace's tool is named as in its namespace."""
    kind, name, namespace = request.shaping.get("tools", {}).get(call.name, ("function", call.name, None))
    if kind == "custom":
        try:
            value = json.loads(call.arguments)
        except (json.JSONDecodeError, RecursionError):
            value = None
        text = value.get("input") if isinstance(value, dict) else None
        item = {
            "type": "custom_tool_call",
            "id": f"ctc_{_ids(call_id)}_{j}",
            "call_id": call.id,
            "name": name,
            "input": text if isinstance(text, str) else call.arguments,
        }
    else:
        item = {
            "type": "function_call",
            "id": f"fc_{_ids(call_id)}_{j}",
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments,
        }
    if namespace is not None:
        item["namespace"] = namespace
    return {**item, "status": "completed"}


def output_items(
    request: TurnRequest, call_id: str, out: TurnOutput, force_message: bool = False
) -> list[dict[str, Any]]:
    """A choice's output items: reasoning, message, tool calls (the order the input parser folds
    back into one assistant message)."""
    items = []
    if out.reasoning:
        items.append(_reasoning_item(call_id, out.reasoning, bool(request.shaping.get("seal_reasoning"))))
    if out.content or force_message or not (out.tool_calls or out.reasoning):
        lps = _logprobs(out.logprobs) if out.logprobs is not None else []
        items.append(_message_item(call_id, out.content or "", lps))
    items += [_call_item(request, call_id, j, c) for j, c in enumerate(out.tool_calls)]
    return items


def _usage(result: TurnResult, out: TurnOutput) -> dict[str, Any]:
    completion = result.completion_tokens
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + completion,
    }


def _head(
    call_id: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A `response` object's own fields, before the request's echoed ones (`answer`)."""
    return {
        "id": call_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": usage,
        "text": {"format": {"type": "text"}},  # a request's own `text` (echoed) replaces it
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
    }


_HEAD_KEYS = frozenset(_head("", 0, "", "completed", [], None))


_TAILS: dict[bytes, str] = {}
_TAILS_KEPT = 64


def _echo_tail(rest: dict[str, Any]) -> str:
    """`json.dumps(rest, ensure_ascii=False)[1:-1]`, kept by the fields' orjson text (in C: 4 us
    against 76 us for Codex's 18 KB of instructions and tools): a harness echoes the same
    instructions and tools on every call of every session. The same orjson text is the same values
    in the same order, so the same `json.dumps` text: the body was parsed by orjson (no NaN or
    infinity, which orjson would write as null; no subclasses) and orjson writes each float in its
    shortest round-trip form. The oldest of `_TAILS_KEPT` goes."""
    try:
        key = orjson.dumps(rest)
    except (TypeError, orjson.JSONEncodeError):  # not from a JSON body (an int past 64 bits)
        return json.dumps(rest, ensure_ascii=False)[1:-1]
    tail = _TAILS.get(key)
    if tail is None:
        tail = json.dumps(rest, ensure_ascii=False)[1:-1]
        if len(_TAILS) >= _TAILS_KEPT:
            del _TAILS[next(iter(_TAILS))]
        _TAILS[key] = tail
    return tail


class _EchoJson:
    """The request's echoed fields of a stream's `response` events, as JSON dumped once (and kept
    across calls, `_echo_tail`).

    Three events carry the whole response (created, in_progress, then completed, incomplete or
    failed), each with the request's `instructions` and `tools` echoed: ~30 KB of a Codex request,
    ~0.1 ms of `json.dumps` each time. The fields a response has of its own (`text`) take the
    echo's value in their place; the rest follow them in the echo's order, as `answer` merges
    them, so an event's text is `json.dumps` of that merged object byte for byte."""

    def __init__(self, echo: dict[str, Any]) -> None:
        self.inline = {k: v for k, v in echo.items() if k in _HEAD_KEYS}
        rest = {k: v for k, v in echo.items() if k not in _HEAD_KEYS}
        self.tail = _echo_tail(rest) if rest else ""  # '"k": v, ...'

    def dumps(self, head: dict[str, Any]) -> str:
        """`json.dumps` of `{**head, **echo}` (`head` holds every key of `_head`)."""
        text = json.dumps({**head, **self.inline}, ensure_ascii=False)
        return f"{text[:-1]}, {self.tail}}}" if self.tail else text


def answer(request: TurnRequest, result: TurnResult, force_message: bool = False) -> dict[str, Any]:
    return {**_answer_head(request, result, force_message), **request.echo}


def _answer_head(request: TurnRequest, result: TurnResult, force_message: bool) -> dict[str, Any]:
    """`answer` without the request's echoed fields."""
    out = result.outputs[0]
    status = "incomplete" if out.finish == "length" else "completed"
    items = output_items(request, result.call_id, out, force_message)
    return _head(result.call_id, result.created, result.model, status, items, _usage(result, out))


class _Events:
    """Numbers a stream's events (`sequence_number`, as upstream)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> str:
        self.n += 1
        return sse({"type": kind, "sequence_number": self.n - 1, **data}, event=kind)

    def response(self, kind: str, head: dict[str, Any], echo: _EchoJson) -> str:
        """`self(kind, response={**head, **echo})`, the echo's JSON not dumped again."""
        self.n += 1
        return sse_json(
            f'{{"type": {json.dumps(kind, ensure_ascii=False)}, "sequence_number": {self.n - 1}, "response": {echo.dumps(head)}}}',
            event=kind,
        )


def _item_events(ev: _Events, index: int, item: dict[str, Any]) -> list[str]:
    """The added -> content -> done events of an output item sent whole at the end."""
    kind, item_id = item["type"], item["id"]
    if kind == "message":
        part = item["content"][0]
        opened = {**item, "status": "in_progress", "content": []}
        empty = {**part, "text": "", "logprobs": []}
        return [
            ev("response.output_item.added", output_index=index, item=opened),
            ev(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=empty,
            ),
            *_text_done(ev, index, item, part["text"]),
        ]
    if kind == "reasoning":
        text = item["content"][0]["text"]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            ev(
                "response.output_item.added",
                output_index=index,
                item={**item, "content": [], "status": "in_progress"},
            ),
            ev("response.reasoning_text.delta", **where, delta=text),
            ev("response.reasoning_text.done", **where, text=text),
            ev("response.output_item.done", output_index=index, item=item),
        ]
    if kind == "custom_tool_call":
        text = item["input"]
        return [
            ev(
                "response.output_item.added",
                output_index=index,
                item={**item, "input": "", "status": "in_progress"},
            ),
            ev("response.custom_tool_call_input.delta", item_id=item_id, output_index=index, delta=text),
            ev("response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=text),
            ev("response.output_item.done", output_index=index, item=item),
        ]
    args = item["arguments"]
    return [
        ev(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        ),
        ev("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=args),
        ev(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=index,
            arguments=args,
            name=item["name"],
        ),
        ev("response.output_item.done", output_index=index, item=item),
    ]


def _text_done(ev: _Events, index: int, item: dict[str, Any], unsent: str) -> list[str]:
    """The rest of a message item's text, then its done events."""
    part, item_id = item["content"][0], item["id"]
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    events = [ev("response.output_text.delta", **where, delta=unsent, logprobs=[])] if unsent else []
    return [
        *events,
        ev("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
        ev("response.content_part.done", **where, part=part),
        ev("response.output_item.done", output_index=index, item=item),
    ]


async def stream(
    request: TurnRequest, events: AsyncGenerator[StreamEvent, None]
) -> AsyncGenerator[str, None]:
    ev = _Events()
    echo = _EchoJson(request.echo)
    call_id, created, model = "", 0, ""
    opened = False  # the message item went out while sampling (content streams first)
    async for event in events:
        if isinstance(event, StreamStarted):
            call_id, created, model = event.call_id, event.created, event.model
            head = _head(call_id, created, model, "in_progress", [], None)
            yield ev.response("response.created", head, echo) + ev.response(
                "response.in_progress", head, echo
            )
        elif isinstance(event, TextDelta):
            item_id = f"msg_{_ids(call_id)}"
            if not opened:
                opened = True
                yield ev(
                    "response.output_item.added",
                    output_index=0,
                    item=_message_item(call_id, "", [], "in_progress"),
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield ev(
                    "response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part
                )
            lps = _logprobs(event.logprobs)
            yield ev(
                "response.output_text.delta",
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=event.text,
                logprobs=lps,
            )
        elif isinstance(event, StreamFailed):
            failed = _head(call_id, created, model, "failed", [], None)
            failed["error"] = {"code": event.error.code or "server_error", "message": event.error.message}
            yield ev.response("response.failed", failed, echo)
            return
        elif isinstance(event, StreamFinished):
            # the last piece's events in one write (one send through the ASGI layers, one packet)
            final = _answer_head(request, event.result, force_message=opened)
            parts: list[str] = []
            for index, item in enumerate(final["output"]):
                if opened and item["type"] == "message":
                    parts += _text_done(ev, index, item, event.unsent)
                else:
                    parts += _item_events(ev, index, item)
            done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            parts.append(ev.response(done, final, echo))
            yield "".join(parts)
