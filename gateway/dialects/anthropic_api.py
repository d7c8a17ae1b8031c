"""The Anthropic Messages dialect (`POST /s/{sid}/v1/messages`, `/v1/messages/count_tokens`).

`parse` turns a Messages body into the core's `TurnRequest`; `answer` and `stream` shape the
core's results into a `message` object and Anthropic's server-sent events; `error_body` is
Anthropic's error envelope (`routes.py` answers this dialect's errors in it). `dialect.py`
describes the seam; docs/gateway.md lists what is honoured and what is refused.

Content blocks map onto the internal (OpenAI chat) messages the renderer reads:

* `system` (a string or text blocks) -> a leading system message;
* a user message's `text` blocks -> a user message, each `tool_result` block -> a `tool` message
  (in block order; text after results becomes a user message after them);
* an assistant message's `thinking`, `text` and `tool_use` blocks -> one assistant message
  (reasoning_content, content, tool_calls): exactly how `answer` lays a reply out, so a reply sent
  back is the message the bridge matches (`dialect.reply_message`).

`cache_control` (top level or on blocks) is accepted and has nothing to do: the engines cache every
prefix. Sampling fields newer SDKs no longer send (`temperature`, `top_p`, `top_k`) are honoured when
given; fields the gateway cannot honour (`container`, `output_config`, `mcp_servers`, ...) are a 400
naming the field.

Stream events, in order: `message_start`, then per content block `content_block_start`,
`content_block_delta` (`thinking_delta` + `signature_delta`, `text_delta`, `input_json_delta`),
`content_block_stop`; then `message_delta` (stop reason, output usage) and `message_stop`; an
engine failure mid-stream is an `error` event. Text streams as it is sampled; thinking and tool
calls are parsed whole and arrive at the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from palaestra.gateway.dialect import (
    GenerationParams,
    Reasoning,
    StreamEvent,
    StreamFailed,
    StreamFinished,
    StreamStarted,
    TextDelta,
    TurnOutput,
    TurnRequest,
    TurnResult,
)
from palaestra.gateway.dialects.controls import MESSAGES, Recorder, screen
from palaestra.gateway.dialects.sealed import seal, unseal
from palaestra.gateway.dialects.validate import MAX_NEW_TOKENS, number, stop_list
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import normalize_messages, normalize_more
from palaestra.gateway.sessions.history import ParseMemo
from palaestra.gateway.streaming import sse

COUNT_FIELDS = (
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
    "cache_control", "context_management", "mcp_servers",
)  # fmt: skip
"""The fields of `/messages/count_tokens` (treated as in `controls.MESSAGES`)."""
COUNT_TABLE = {k: MESSAGES[k] for k in COUNT_FIELDS}
BETA_HEADER = "anthropic-beta"

# HTTP status -> Anthropic's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """Anthropic's envelope (`ANTHROPIC_MESSAGES.error_body`). It has no `param` or `code`: its
    messages start with the field's path instead ("max_tokens: ..."), so a core error in OpenAI's
    words ("'max_tokens' must be ...") is put that way, and one that names no field gets it in front."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message
    if exc.param and message.startswith(f"'{exc.param}' "):
        message = f"{exc.param}: {message[len(exc.param) + 3 :]}"
    elif exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _screen(body: dict[str, Any], table: dict[str, Any], headers: dict[str, str] | None) -> Recorder:
    """The body's top-level fields against the Messages table (`controls.screen`), plus the beta
    flags of the `anthropic-beta` header, each recorded as `anthropic-beta=<flag>`."""
    recorder = screen(
        body,
        table,
        lambda key: GatewayError(f"{key}: Extra inputs are not permitted", param=key),
        lambda key, why: GatewayError(f"{key}: not supported here: {why}", param=key),
    )
    for flag in ((headers or {}).get(BETA_HEADER) or "").split(","):
        if flag.strip():
            recorder.note(BETA_HEADER, flag.strip())
    return recorder


def _params(body: dict[str, Any]) -> GenerationParams:
    if body.get("max_tokens") is None:
        raise GatewayError("max_tokens: Field required", param="max_tokens")
    max_tokens = number(
        body, "max_tokens", 1, MAX_NEW_TOKENS, integer=True
    )  # clamped to the context (service)
    temperature, top_p = number(body, "temperature", 0, 1), number(body, "top_p", 0, 1)
    sampling: dict[str, Any] = {
        "temperature": 1.0 if temperature is None else temperature,  # Anthropic's default
        "top_p": 1.0 if top_p is None else max(top_p, 1e-6),
    }
    if body.get("top_k") is not None:
        sampling["top_k"] = number(body, "top_k", 1, 1 << 30, integer=True)
    stops = stop_list(body, "stop_sequences")
    if stops:
        sampling["stop"] = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError("stream: must be a boolean", param="stream")
    return GenerationParams(sampling, 1, stream, False, False, 0, list(stops), max_tokens)


def _text(content: Any, where: str) -> str:
    """A system prompt or a text-only content: a string or text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text", ""), str)
        for b in content
    ):
        return "".join(b.get("text", "") for b in content)
    raise GatewayError(f"{where}: must be a string or an array of text blocks", param=where.split(".")[0])


def _string(block: dict[str, Any], key: str, where: str) -> str:
    """A block's string field (absent or null: empty); another type is a 400 naming it."""
    value = block.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise GatewayError(f"{where}.{key}: must be a string", param="messages")
    return value


def _history(system: Any, raw: Any, memo: ParseMemo | None) -> list[dict[str, Any]]:
    """The system prompt and the messages as normalised internal messages."""
    head = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    if not isinstance(raw, list) or not raw:
        raise GatewayError("messages: must be a non-empty array", param="messages")
    if memo is None:
        return normalize_messages(head + _convert(raw, 0)[0])
    return normalize_more(head) + memo.history("messages", raw, _convert, len(head))


def _convert(raw: list[Any], start: int) -> tuple[list[dict[str, Any]], bool]:
    """Messages (the first at position `start`) -> internal messages; each closes its own."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw, start):
        # the common shapes first, with no block walk: this loop runs over the whole history per call
        if type(m) is dict and len(m) == 2:
            role, content = m.get("role"), m.get("content")
            if role == "user" and type(content) is str:
                out.append(m)
                continue
            if role == "assistant" and type(content) is list and len(content) == 1:
                block = content[0]
                if type(block) is dict and block.get("type") == "text" and type(block.get("text")) is str:
                    if len(block) == 2:
                        out.append({"role": "assistant", "content": block["text"]})
                        continue
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise GatewayError(f"{where}.role: must be 'user', 'assistant' or 'system'", param="messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise GatewayError(f"{where}.content: must be a string or an array of blocks", param="messages")
        if m["role"] == "assistant":
            out.append(_assistant(blocks, where))
        elif m["role"] == "system":  # Claude Code's system reminders; placed by `controls.resolve`
            out.append({"role": "system", "content": _text(blocks, f"{where}.content")})
        else:
            out += _user(blocks, where)
    return out, True


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            msg["content"] += _string(b, "text", f"{where}.content.{j}")
        elif kind == "thinking":
            # the text as sent, or (display "omitted": empty) the reasoning sealed in the signature
            text = _string(b, "thinking", f"{where}.content.{j}")
            signature = _string(b, "signature", f"{where}.content.{j}")
            msg["reasoning_content"] = text or unseal(signature) or ""
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                raise GatewayError(f"{where}.content.{j}: tool_use needs 'id' and 'name'", param="messages")
            fn = {"name": b["name"], "arguments": b.get("input", {})}
            msg.setdefault("tool_calls", []).append({"id": b["id"], "type": "function", "function": fn})
        else:
            raise GatewayError(
                f"{where}.content.{j}.type: {kind!r} is not supported in assistant messages "
                "(text, thinking, tool_use: the blocks this gateway answers with)",
                param="messages",
            )
    return msg


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(_string(b, "text", f"{where}.content.{j}"))
        elif kind == "tool_result":
            if text:  # text before a result stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            body = b.get("content", "")
            result = _text(body, f"{where}.content.{j}.content") if body is not None else ""
            call_id = _string(b, "tool_use_id", f"{where}.content.{j}")
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise GatewayError(
                f"{where}.content.{j}.type: {kind!r} is not supported in user messages (text, tool_result: "
                "a text-only model cannot see images or documents)",
                param="messages",
            )
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


# Anthropic-defined client tools: the client runs them, the API shows the model their schema. The
# gateway shows the template these (its own) schemas under the tool's name.
_BASH = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The shell command to run."},
        "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."},
    },
}
_EDITOR = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string", "description": "Absolute path of the file or directory."},
        "file_text": {"type": "string", "description": "create: the whole file."},
        "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
        "new_str": {"type": "string", "description": "str_replace / insert: the new text."},
        "insert_line": {"type": "integer", "description": "insert: the line after which to insert."},
        "view_range": {"type": "array", "items": {"type": "integer"}, "description": "view: [start, end]."},
    },
    "required": ["command", "path"],
}
CLIENT_TOOLS = {
    "bash_20241022": ("Run a shell command in a persistent bash session.", _BASH),
    "bash_20250124": ("Run a shell command in a persistent bash session.", _BASH),
    "text_editor_20241022": ("View, create and edit files.", _EDITOR),
    "text_editor_20250124": ("View, create and edit files.", _EDITOR),
    "text_editor_20250429": ("View, create and edit files.", _EDITOR),
    "text_editor_20250728": ("View, create and edit files.", _EDITOR),
}
"""Anthropic-defined tool type -> (description, input schema) rendered for it."""
SERVER_TOOL_PREFIXES = (
    "web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset", "computer_",
    "memory_",
)  # fmt: skip
"""Tool types the API runs itself (or that need screenshots): recorded, not shown to the model."""
_TOOL_FIELDS = ("cache_control", "type", "name", "description", "input_schema", "input_examples")
_TOOL_RECORDED = ("defer_loading", "strict", "allowed_callers", "eager_input_streaming")
"""Tool fields nothing here acts on (tool search, strict inputs, programmatic callers): recorded."""


def _tools(raw: Any, recorder: Recorder) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise GatewayError("tools: must be an array", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise GatewayError(f"tools.{i}: must be an object", param="tools")
        kind = t.get("type", "custom")
        if not isinstance(kind, str):  # (an object or array is no tool type, and unhashable)
            raise GatewayError(f"tools.{i}.type: must be a string; got {kind!r:.80}", param="tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise GatewayError(f"tools.{i}.name: must be a non-empty string", param="tools")
        if kind in CLIENT_TOOLS:
            description, schema = CLIENT_TOOLS[kind]
        elif isinstance(kind, str) and kind.startswith(SERVER_TOOL_PREFIXES):
            recorder.note("tools", kind)
            continue
        elif kind == "custom":
            description, schema = t.get("description", ""), t.get("input_schema")
            if description is None:
                description = ""
            if not isinstance(description, str):
                raise GatewayError(f"tools.{i}.description: must be a string", param="tools")
            if not isinstance(schema, dict):
                raise GatewayError(
                    f"tools.{i}.input_schema: Field required (a JSON schema object)", param="tools"
                )
        else:
            raise GatewayError(
                f"tools.{i}.type: {kind!r} is not a tool type of the Messages API this gateway knows "
                "(custom tools, bash_*, text_editor_*; server tools are recorded)",
                param="tools",
            )
        for extra in sorted(set(t) - set(_TOOL_FIELDS)):
            if extra not in _TOOL_RECORDED:
                raise GatewayError(f"tools.{i}.{extra}: Extra inputs are not permitted", param="tools")
            if t[extra] not in (None, False):
                recorder.note(f"tools.{extra}")
        fn = {"name": t["name"], "description": description, "parameters": schema}
        out.append({"type": "function", "function": fn})
    return out or None


def _memo_tools(raw: Any, recorder: Recorder, memo: ParseMemo) -> list[dict[str, Any]] | None:
    """`_tools` through the session's memo: the same tools as the last call's are not converted again
    (what converting them recorded is recorded again)."""

    def convert(raw: Any) -> tuple[list[dict[str, Any]] | None, list[str]]:
        own = Recorder()
        return _tools(raw, own), own.notes

    tools, notes = memo.tools("messages", raw, convert)
    for note in notes:
        recorder.note(note)
    return tools


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None, recorder: Recorder) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "any", "tool") and raw.get("disable_parallel_tool_use"):
        recorder.note("tool_choice.disable_parallel_tool_use")  # every call the model writes is returned
    if kind in ("auto", "none"):
        return kind, None
    if kind == "any":
        if not tools:
            raise GatewayError("tool_choice: 'any' needs tools", param="tool_choice")
        return "required", None
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise GatewayError("tool_choice.name: must be a string", param="tool_choice")
        if not tools or raw["name"] not in {t["function"]["name"] for t in tools}:
            raise GatewayError(f"tool_choice.name: {raw.get('name')!r} is not in tools", param="tool_choice")
        return "named", raw["name"]
    raise GatewayError("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")


def _reasoning(body: dict[str, Any], recorder: Recorder, shaping: dict[str, Any]) -> Reasoning | None:
    """`thinking` (enabled, adaptive: on; disabled: off) with `output_config.effort` -> the
    request's reasoning ask (the core maps it onto the template's switch). `budget_tokens` is
    recorded (the template decides how long the model thinks; max_tokens bounds the turn);
    `display: "omitted"` answers thinking blocks with empty text and the reasoning sealed in the
    signature (`sealed.py`), as upstream."""
    raw, config = body.get("thinking"), body.get("output_config") or {}
    if not isinstance(config, dict):
        raise GatewayError("output_config: must be an object", param="output_config")
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise GatewayError(
            "output_config.effort: must be 'low', 'medium', 'high', 'xhigh' or 'max'", param="output_config"
        )
    if raw is None:
        if effort is not None:
            recorder.note("output_config.effort")  # effort without thinking: nothing to switch
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise GatewayError("thinking.type: must be 'enabled', 'adaptive' or 'disabled'", param="thinking")
    budget = raw.get("budget_tokens")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= MAX_NEW_TOKENS:
            raise GatewayError(
                f"thinking.budget_tokens: must be an integer between 1 and {MAX_NEW_TOKENS}", param="thinking"
            )
        recorder.note("thinking.budget_tokens")
    display = raw.get("display")
    if display not in (None, "summarized", "omitted"):
        raise GatewayError("thinking.display: must be 'summarized' or 'omitted'", param="thinking")
    if display == "omitted":
        shaping["thinking_display"] = "omitted"
    field = "output_config.effort" if effort is not None and kind != "disabled" else "thinking"
    return Reasoning(kind != "disabled", effort, field)


def _output_format(body: dict[str, Any], recorder: Recorder) -> dict[str, str]:
    """`output_config.format` -> constrained decoding (`openai_request.constraint`'s mapping)."""
    config = body.get("output_config") or {}
    if not isinstance(config, dict):
        raise GatewayError("output_config: must be an object", param="output_config")
    for key in sorted(set(config) - {"effort", "format"}):
        recorder.note(f"output_config.{key}")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise GatewayError(
            "output_config.format: must be {'type': 'json_schema', 'schema': {...}}", param="output_config"
        )
    return {"json_schema": json.dumps(fmt["schema"])}


def parse(
    body: dict[str, Any], memo: ParseMemo | None = None, headers: dict[str, str] | None = None
) -> TurnRequest:
    """A `/messages` body -> the core's request (`memo`: the session's, see `history.py`; `headers`:
    the `anthropic-beta` flags)."""
    recorder = _screen(body, MESSAGES, headers)
    params = _params(body)
    params.sampling.update(_output_format(body, recorder))
    return _request(body, params, recorder, memo)


def parse_count(body: dict[str, Any]) -> TurnRequest:
    """A `/messages/count_tokens` body -> a request that is only rendered (never generated)."""
    recorder = _screen(body, COUNT_TABLE, None)
    return _request(body, GenerationParams({}, 1, False, False, False, 0, [], None), recorder)


def _request(
    body: dict[str, Any], params: GenerationParams, recorder: Recorder, memo: ParseMemo | None = None
) -> TurnRequest:
    messages = _history(body.get("system"), body.get("messages"), memo)
    tools = (
        _tools(body.get("tools"), recorder)
        if memo is None
        else _memo_tools(body.get("tools"), recorder, memo)
    )
    tool_choice, named = _tool_choice(body.get("tool_choice"), tools, recorder)
    shaping: dict[str, Any] = {}
    reasoning = _reasoning(body, recorder, shaping)
    return TurnRequest(
        messages,
        tools,
        tool_choice,
        params,
        named_tool=named,
        shaping=shaping,
        reasoning=reasoning,
        ignored=recorder.notes,
    )


# -- answers --------------------------------------------------------------------------------------
def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {}


def content_blocks(out: TurnOutput, omit_thinking: bool = False) -> list[dict[str, Any]]:
    """thinking, text, tool_use: the order `_assistant` folds back into one message. A thinking
    block's signature seals its reasoning (`sealed.py`); `omit_thinking` (display "omitted") leaves
    its text empty, as upstream."""
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        text = "" if omit_thinking else out.reasoning
        blocks.append({"type": "thinking", "thinking": text, "signature": seal(out.reasoning)})
    if out.content or not (out.tool_calls or out.reasoning):
        blocks.append({"type": "text", "text": out.content or ""})
    for c in out.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return blocks


def _omitted(request: TurnRequest) -> bool:
    return request.shaping.get("thinking_display") == "omitted"


def stop_reason(request: TurnRequest, out: TurnOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice."""
    if out.finish == "tool_calls":
        return "tool_use", None
    if out.finish == "length":
        return "max_tokens", None
    if isinstance(out.stop_matched, str) and out.stop_matched in request.params.stop:
        return "stop_sequence", out.stop_matched
    return "end_turn", None


def _usage(result: TurnResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "output_tokens": result.completion_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def answer(request: TurnRequest, result: TurnResult) -> dict[str, Any]:
    out = result.outputs[0]
    reason, sequence = stop_reason(request, out)
    return {
        "id": result.call_id,
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": content_blocks(out, _omitted(request)),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(result),
    }


def _event(kind: str, **data: Any) -> str:
    return sse({"type": kind, **data}, event=kind)


def _block_events(index: int, block: dict[str, Any]) -> list[str]:
    """start -> delta(s) -> stop of a block sent whole at the end."""
    kind = block["type"]
    if kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif kind == "text":
        start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    else:
        start = {**block, "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        ]
    return [
        _event("content_block_start", index=index, content_block=start),
        *[_event("content_block_delta", index=index, delta=d) for d in deltas],
        _event("content_block_stop", index=index),
    ]


async def stream(
    request: TurnRequest, events: AsyncGenerator[StreamEvent, None]
) -> AsyncGenerator[str, None]:
    opened = False  # the text block went out while sampling (text streams first)
    async for event in events:
        if isinstance(event, StreamStarted):
            message = {
                "id": event.call_id,
                "type": "message",
                "role": "assistant",
                "model": event.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": event.prompt_tokens, "output_tokens": 0},
            }
            yield _event("message_start", message=message)
        elif isinstance(event, TextDelta):
            delta = _event("content_block_delta", index=0, delta={"type": "text_delta", "text": event.text})
            if not opened:
                opened = True
                start = _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                delta = start + delta
            yield delta
        elif isinstance(event, StreamFailed):
            yield _event("error", error=error_body(event.error)["error"])
            return
        elif isinstance(event, StreamFinished):
            # the last piece's events in one write (one send through the ASGI layers, one packet)
            parts: list[str] = []
            out = event.result.outputs[0]
            blocks = content_blocks(out, _omitted(request))
            if opened and blocks[0]["type"] != "text":
                blocks.insert(0, {"type": "text", "text": ""})  # the block that already went out
            for index, block in enumerate(blocks):
                if opened and index == 0:
                    if event.unsent:
                        parts.append(
                            _event(
                                "content_block_delta",
                                index=0,
                                delta={"type": "text_delta", "text": event.unsent},
                            )
                        )
                    parts.append(_event("content_block_stop", index=0))
                else:
                    parts += _block_events(index, block)
            reason, sequence = stop_reason(request, out)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            parts.append(
                _event("message_delta", delta=delta, usage={"output_tokens": event.result.completion_tokens})
            )
            parts.append(_event("message_stop"))
            yield "".join(parts)
