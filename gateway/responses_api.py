"""The OpenAI Responses API dialect (`POST /s/{sid}/v1/responses`): the parser.

`parse` turns a Responses body into the core's `TurnRequest`; `responses_answer.py` shapes the
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
"""

from __future__ import annotations

import math
from typing import Any

from palaestra.gateway.dialect import GenerationParams, TurnRequest
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.history import ParseMemo
from palaestra.gateway.openai_request import constraints
from palaestra.gateway.renderer import normalize_messages, normalize_more
from palaestra.gateway.validate import SEED_RANGE, number, stop_list

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


def _params(body: dict[str, Any]) -> GenerationParams:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise GatewayError(f"Unknown parameter: '{unknown[0]}'.", param=unknown[0])
    temperature, top_p = number(body, "temperature", 0, 2), number(body, "top_p", 0, 1)
    sampling: dict[str, Any] = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else max(top_p, 1e-6),
    }
    for key, lo, hi, integer, name in (
        ("top_k", -1, 1 << 30, True, "top_k"),
        ("min_p", 0, 1, False, "min_p"),
        ("repetition_penalty", 0.01, 2, False, "repetition_penalty"),
        ("seed", *SEED_RANGE, True, "sampling_seed"),
    ):
        if body.get(key) is not None:
            sampling[name] = number(body, key, lo, hi, integer=integer)
    stops = stop_list(body, "stop")
    if stops:
        sampling["stop"] = stops
    # no upper bound here: any dialect's max_tokens beyond the context is a 400 naming it (service)
    max_tokens = number(body, "max_output_tokens", 1, math.inf, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError("'stream' must be a boolean", param="stream")
    include = body.get("include") or []
    allowed = lambda i: isinstance(i, str) and i in INCLUDES  # noqa: E731 (an unhashable item is refused)
    if not isinstance(include, list) or not all(allowed(i) for i in include):
        bad = next((i for i in include if not allowed(i)), include) if isinstance(include, list) else include
        raise _refuse("include", f"{bad!r}; only {sorted(INCLUDES)} can be included")
    logprobs = "message.output_text.logprobs" in include
    top = number(body, "top_logprobs", 0, 20, integer=True) or 0
    return GenerationParams(
        sampling, 1, stream, False, logprobs, top, list(stops), max_tokens, "max_output_tokens"
    )


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
        text = content[0].get("text", "")
        if type(text) is str:
            return text
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
        raise GatewayError("input: a content part's 'text' must be a string", param="input")
    return ""


def _history(preamble: list[dict[str, Any]], items: Any, memo: ParseMemo | None) -> list[dict[str, Any]]:
    """The preamble and the input items as normalised internal messages."""
    if isinstance(items, str):
        return normalize_messages([*preamble, {"role": "user", "content": items}])
    if not isinstance(items, list) or not items:
        raise GatewayError("'input' must be a string or a non-empty array of items", param="input")
    if memo is None:
        return normalize_messages(preamble + _convert(items, 0)[0])
    return normalize_more(preamble) + memo.history("responses", items, _convert, len(preamble))


def _convert(items: list[Any], start: int) -> tuple[list[dict[str, Any]], bool]:
    """Input items (the first at position `start`) -> OpenAI chat messages (then normalised by the
    renderer's rules), and whether the last one closed its message (no assistant run open)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled from a run of items

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    # this loop runs over the whole history on every call: the common items are handled first
    for i, item in enumerate(items, start):
        if not isinstance(item, dict):
            raise GatewayError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role != "assistant":
                turn = None
                out.append(item if len(item) == 2 else {"role": role, "content": item.get("content")})
            elif turn is None:  # what `answer` sends back: one output_text part, inlined
                content = item.get("content")
                text = None
                if type(content) is list and len(content) == 1 and type(content[0]) is dict:
                    text = content[0].get("text", "")
                if type(text) is not str:
                    text = _output_text(content)
                turn = {"role": "assistant", "content": text}
                out.append(turn)
            else:
                turn["content"] += _output_text(item.get("content"))
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
    return out, turn is None


def parse(body: dict[str, Any], memo: ParseMemo | None = None) -> TurnRequest:
    """A `/responses` body -> the core's request (`memo`: the session's, see `history.py`)."""
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
    messages = _history(preamble, body.get("input"), memo)
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
