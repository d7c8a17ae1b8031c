"""The OpenAI Responses API dialect (`POST /s/{sid}/v1/responses`): parser and shapers.

`parse` turns a Responses body into the core's `TurnRequest`; `answer` and `stream` shape the
core's `TurnResult` / stream events into a `response` object and its server-sent events.
`dialect.py` describes the seam; docs/gateway.md lists what is honoured and what is refused.

Input items map onto the internal (OpenAI chat) messages the renderer reads:

* `{"role": ..., "content": ...}` messages (type `message`, or no type): system / developer /
  user / assistant, content a string or `input_text` / `output_text` parts;
* a run of `reasoning`, assistant `message` and `function_call` items is one assistant message
  (reasoning_content, content, tool_calls) -- exactly how `answer` lays a reply out, so a reply
  sent back is the message the bridge matches (`dialect.reply_message`);
* `function_call_output` -> a `tool` message.

`instructions` become a leading system message that is not kept with the conversation (as
upstream: a later call's `previous_response_id` does not carry them over). With `store` (the
default, as upstream) the session keeps each response's conversation for `previous_response_id`.

Stream events, in order: `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its content events (`response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`;
`response.reasoning_text.delta` / `.done` for reasoning; `response.function_call_arguments.delta`
/ `.done` for calls), `response.output_item.done`, and last `response.completed` (or
`response.incomplete` when cut by `max_output_tokens`, `response.failed` when the engine failed).
Content streams as it is sampled; reasoning and calls are parsed whole and arrive at the end.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from palaestra.gateway.dialect import (
    GenerationParams,
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
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.openai_request import constraints
from palaestra.gateway.renderer import normalize_messages
from palaestra.gateway.streaming import sse

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "stream",
    "stream_options",
    "previous_response_id",
    "store",
    "metadata",
    "include",
    "text",
    "truncation",
    "reasoning",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
    # SGLang extensions sent through `extra_body`, as on chat
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "chat_template_kwargs",
    "regex",
    "ebnf",
}
INCLUDES = {"message.output_text.logprobs"}


def _refuse(field: str, why: str) -> GatewayError:
    return GatewayError(f"'{field}' is not supported: {why}", param=field)


def _number(body: dict[str, Any], key: str, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        raise GatewayError(f"'{key}' must be {'an integer' if integer else 'a number'}", param=key)
    if not lo <= value <= hi:
        raise GatewayError(f"'{key}' must be between {lo} and {hi}; got {value}", param=key)
    return int(value) if integer else float(value)


def _params(body: dict[str, Any]) -> GenerationParams:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise GatewayError(f"Unknown parameter: '{unknown[0]}'.", param=unknown[0])
    temperature, top_p = _number(body, "temperature", 0, 2), _number(body, "top_p", 0, 1)
    sampling: dict[str, Any] = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else max(top_p, 1e-6),
    }
    for key, lo, hi, integer, name in (
        ("top_k", -1, 1 << 30, True, "top_k"),
        ("min_p", 0, 1, False, "min_p"),
        ("repetition_penalty", 0.01, 2, False, "repetition_penalty"),
        ("seed", -(1 << 62), 1 << 62, True, "sampling_seed"),
    ):
        if body.get(key) is not None:
            sampling[name] = _number(body, key, lo, hi, integer)
    stops = body.get("stop") or []
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > 16:
        raise GatewayError("'stop' must be an array of up to 16 non-empty strings", param="stop")
    if stops:
        sampling["stop"] = stops
    max_tokens = _number(body, "max_output_tokens", 1, 1 << 30, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError("'stream' must be a boolean", param="stream")
    include = body.get("include") or []
    if not isinstance(include, list) or any(i not in INCLUDES for i in include):
        bad = (
            next((i for i in include if i not in INCLUDES), include) if isinstance(include, list) else include
        )
        raise _refuse("include", f"{bad!r}; only {sorted(INCLUDES)} can be included")
    logprobs = "message.output_text.logprobs" in include
    top = _number(body, "top_logprobs", 0, 20, integer=True) or 0
    return GenerationParams(sampling, 1, stream, False, logprobs, top, list(stops), max_tokens)


def _check_unhonoured(body: dict[str, Any]) -> None:
    """Fields the gateway accepts only in their do-nothing form (any other value would be dropped)."""
    if body.get("truncation") not in (None, "disabled"):
        raise _refuse("truncation", "the gateway never drops input items ('disabled' only)")
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict) and not any(reasoning.values())):
        raise _refuse(
            "reasoning",
            "effort and summaries are not controls of an open model; use chat_template_kwargs "
            "(e.g. {'enable_thinking': false})",
        )
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise GatewayError("'text' must be an object", param="text")
    if body.get("text") and set(body["text"]) - {"format"}:
        raise _refuse("text", f"only 'format' is supported; got {sorted(body['text'])}")


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise GatewayError("'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise GatewayError(f"tools[{i}]: only function tools are supported; got {kind!r}", param="tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise GatewayError(f"tools[{i}].name must be a non-empty string", param="tools")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise GatewayError(f"tools[{i}].parameters must be a JSON schema object", param="tools")
        fn = {"name": t["name"], "description": t.get("description") or "", "parameters": params or {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("auto", "none", "required"):
        if raw == "required" and not tools:
            raise GatewayError("tool_choice 'required' needs 'tools'", param="tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise GatewayError(f"tool_choice names a function not in 'tools': {name!r}", param="tool_choice")
        return "named", name
    raise GatewayError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _output_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if type(content) is list and len(content) == 1 and type(content[0]) is dict:  # the usual one part
        return content[0].get("text", "")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _messages(items: Any) -> list[dict[str, Any]]:
    """Input items -> OpenAI chat messages (then normalised by the renderer's rules)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise GatewayError("'input' must be a string or a non-empty array of items", param="input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled from a run of items

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    # this loop runs over the whole history on every call: the common items are handled first
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise GatewayError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "message" and role != "assistant":
            turn = None
            out.append(item if len(item) == 2 else {"role": role, "content": item.get("content")})
            continue
        if kind == "message":
            msg = assistant()
            msg["content"] += _output_text(item.get("content"))
        elif kind == "reasoning":
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                turn = None  # reasoning opens the next assistant turn
            parts = item.get("content") or item.get("summary") or []
            assistant()["reasoning_content"] = _output_text(parts)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise GatewayError(f"input[{i}]: a function_call needs 'name' and 'call_id'", param="input")
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item.get("arguments", "{}")}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            turn = None
            if not isinstance(item.get("call_id"), str):
                raise GatewayError(f"input[{i}]: a function_call_output needs 'call_id'", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output")})
        else:
            raise GatewayError(
                f"input[{i}].type {kind!r} is not supported (message, reasoning, function_call, "
                "function_call_output)",
                param="input",
            )
    return out


def parse(body: dict[str, Any]) -> TurnRequest:
    """A `/responses` body -> the core's request."""
    params = _params(body)
    _check_unhonoured(body)
    fmt = (body.get("text") or {}).get("format")
    params.sampling.update(constraints(body, fmt, "text.format"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError("'instructions' must be a string", param="instructions")
    preamble = [{"role": "system", "content": instructions}] if instructions else []
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise GatewayError("'previous_response_id' must be a string", param="previous_response_id")
    messages = normalize_messages(preamble + _messages(body.get("input")))
    tools = _tools(body.get("tools"))
    tool_choice, named = _tool_choice(body.get("tool_choice"), tools)
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise GatewayError("'store' must be a boolean", param="store")
    extra = body.get("chat_template_kwargs") or None
    if extra is not None and not isinstance(extra, dict):
        raise GatewayError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    echo = {
        "instructions": instructions,
        "metadata": body.get("metadata") or {},
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "temperature": params.sampling["temperature"],
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": params.max_tokens,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "store": store,
        "top_logprobs": params.top_logprobs,
        "text": body.get("text") or {"format": {"type": "text"}},
    }
    return TurnRequest(
        messages,
        tools,
        tool_choice,
        params,
        named_tool=named,
        template_kwargs=extra,
        echo=echo,
        previous=previous,
        preamble=len(preamble),
        store=store,
    )


# -- answers --------------------------------------------------------------------------------------
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


def _reasoning_item(call_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "id": f"rs_{_ids(call_id)}", "summary": []}
    item["content"] = [{"type": "reasoning_text", "text": text}]
    return {**item, "status": status}


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


def _call_item(call_id: str, j: int, call: Any, arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{_ids(call_id)}_{j}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


def output_items(call_id: str, out: TurnOutput, force_message: bool = False) -> list[dict[str, Any]]:
    """A choice's output items: reasoning, message, function calls (the order the input parser
    folds back into one assistant message)."""
    items = []
    if out.reasoning:
        items.append(_reasoning_item(call_id, out.reasoning))
    if out.content or force_message or not (out.tool_calls or out.reasoning):
        lps = _logprobs(out.logprobs) if out.logprobs is not None else []
        items.append(_message_item(call_id, out.content or "", lps))
    items += [_call_item(call_id, j, c) for j, c in enumerate(out.tool_calls)]
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


def _response(
    request: TurnRequest,
    call_id: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    echo = request.echo
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
        **echo,
    }


def answer(request: TurnRequest, result: TurnResult, force_message: bool = False) -> dict[str, Any]:
    out = result.outputs[0]
    status = "incomplete" if out.finish == "length" else "completed"
    items = output_items(result.call_id, out, force_message)
    return _response(
        request, result.call_id, result.created, result.model, status, items, _usage(result, out)
    )


class _Events:
    """Numbers a stream's events (`sequence_number`, as upstream)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> str:
        self.n += 1
        return sse({"type": kind, "sequence_number": self.n - 1, **data}, event=kind)


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
    call_id, created, model = "", 0, ""
    opened = False  # the message item went out while sampling (content streams first)
    async for event in events:
        if isinstance(event, StreamStarted):
            call_id, created, model = event.call_id, event.created, event.model
            head = _response(request, call_id, created, model, "in_progress", [], None)
            yield ev("response.created", response=head)
            yield ev("response.in_progress", response=head)
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
            failed = _response(request, call_id, created, model, "failed", [], None)
            failed["error"] = {"code": event.error.code or "server_error", "message": event.error.message}
            yield ev("response.failed", response=failed)
            return
        elif isinstance(event, StreamFinished):
            final = answer(request, event.result, force_message=opened)
            for index, item in enumerate(final["output"]):
                if opened and item["type"] == "message":
                    for chunk in _text_done(ev, index, item, event.unsent):
                        yield chunk
                else:
                    for chunk in _item_events(ev, index, item):
                        yield chunk
            done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            yield ev(done, response=final)
