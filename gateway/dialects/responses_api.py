"""The OpenAI Responses API dialect (`POST /s/{sid}/v1/responses`): the parser.

`parse` turns a Responses body into the core's `TurnRequest`; `responses_answer.py` shapes the
core's `TurnResult` / stream events into a `response` object and its server-sent events.
`dialect.py` describes the seam; docs/gateway.md lists what is honoured and what is refused.

Input items map onto the internal (OpenAI chat) messages the renderer reads:

* `{"role": ..., "content": ...}` messages (type `message`, or no type): system / developer /
  user / assistant, content a string or `input_text` / `output_text` parts;
* a run of `reasoning`, assistant `message`, `function_call` and `custom_tool_call` items is one
  assistant message (reasoning_content, content, tool_calls) -- exactly how `answer` lays a reply
  out, so a reply sent back is the message the bridge matches (`dialect.reply_message`); a
  reasoning item's text is its `content`, else the reasoning sealed in its `encrypted_content`
  (`sealed.py`, what `answer` writes with `include: ["reasoning.encrypted_content"]`);
* `function_call_output` / `custom_tool_call_output` -> a `tool` message.

Tools: function tools as they are; a `namespace`'s tools are rendered as `namespace.name` and their
calls answered as that function with its `namespace`; a `custom` (free-form) tool as a function of
one string `input`, its calls answered as `custom_tool_call` items; hosted tools (web_search, ...)
are recorded, not shown (`controls.py` has the table of every field and why).

`instructions` become a leading system message that is not kept with the conversation (as
upstream: a later call's `previous_response_id` does not carry them over). With `store` (the
default, as upstream) the session keeps each response's conversation for `previous_response_id`.
"""

from __future__ import annotations

from typing import Any

from palaestra.gateway.dialect import GenerationParams, Reasoning, TurnRequest
from palaestra.gateway.dialects.controls import RESPONSES, Recorder, screen
from palaestra.gateway.dialects.openai_request import EFFORTS, constraints
from palaestra.gateway.dialects.sealed import unseal
from palaestra.gateway.dialects.validate import MAX_NEW_TOKENS, SEED_RANGE, number, stop_list
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import normalize_messages, normalize_more
from palaestra.gateway.sessions.history import ParseMemo

INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}
"""`include` values that are honoured: logprobs, and reasoning sealed in `encrypted_content`."""
HOSTED_INCLUDES = {
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}  # fmt: skip
"""`include` values about hosted tools' or images' outputs: none are produced here (recorded)."""
HOSTED_TOOLS = {
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer", "computer_use_preview",
    "tool_search",
}  # fmt: skip
"""Tools the API runs itself: recorded, not shown to the model."""
CLIENT_BUILTINS = {"local_shell", "shell", "apply_patch"}
"""OpenAI-defined client tools whose call items (`local_shell_call`, ...) the gateway does not write."""
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
"""The schema a custom (free-form) tool is rendered with: its one string input."""


def _refuse(field: str, why: str) -> GatewayError:
    return GatewayError(f"'{field}' is not supported: {why}", param=field)


def _params(body: dict[str, Any], recorder: Recorder) -> GenerationParams:
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
    # past the context it is clamped, or refused (service, max_tokens_over_context)
    max_tokens = number(body, "max_output_tokens", 1, MAX_NEW_TOKENS, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError("'stream' must be a boolean", param="stream")
    include = body.get("include") or []
    known = lambda i: isinstance(i, str) and i in INCLUDES | HOSTED_INCLUDES  # noqa: E731 (unhashable: refused)
    if not isinstance(include, list) or not all(known(i) for i in include):
        bad = next((i for i in include if not known(i)), include) if isinstance(include, list) else include
        raise _refuse("include", f"{bad!r}; known values are {sorted(INCLUDES | HOSTED_INCLUDES)}")
    for value in include:
        if value in HOSTED_INCLUDES:
            recorder.note("include", value)
    logprobs = "message.output_text.logprobs" in include
    top = number(body, "top_logprobs", 0, 20, integer=True) or 0
    return GenerationParams(
        sampling, 1, stream, False, logprobs, top, list(stops), max_tokens, "max_output_tokens"
    )


def _reasoning(body: dict[str, Any], recorder: Recorder) -> Reasoning | None:
    """`reasoning.effort` -> the request's reasoning ask ("none": off; the core maps it onto the
    template's switch); `summary` / `generate_summary` are recorded (no summaries are written: the
    whole reasoning is returned as `reasoning_text`)."""
    raw = body.get("reasoning")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise GatewayError("'reasoning' must be an object", param="reasoning")
    for key in ("summary", "generate_summary"):
        if raw.get(key) is not None:
            recorder.note(f"reasoning.{key}")
    unknown = sorted(set(raw) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise _refuse("reasoning", f"unknown field {unknown[0]!r} (effort, summary)")
    effort = raw.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise GatewayError(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", param="reasoning")
    return Reasoning(effort != "none", effort, "reasoning.effort")


def _check_text(body: dict[str, Any], recorder: Recorder) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise GatewayError("'text' must be an object", param="text")
    if set(text) - {"format", "verbosity"}:
        raise _refuse("text", f"only 'format' and 'verbosity' are known; got {sorted(text)}")
    if text.get("verbosity") not in (None, "medium"):
        recorder.note("text.verbosity")


def _description(t: dict[str, Any], where: str) -> str:
    """A tool's `description`: a string, or absent (the template prints it as it is)."""
    description = t.get("description")
    if description is not None and not isinstance(description, str):
        raise GatewayError(f"{where}.description must be a string", param="tools")
    return description or ""


def _function(t: dict[str, Any], where: str, name: str, recorder: Recorder) -> dict[str, Any]:
    """A function tool (top level or in a namespace) in `renderer.normalize_tools`' form."""
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise GatewayError(f"{where}.parameters must be a JSON schema object", param="tools")
    for extra in ("strict", "defer_loading", "output_schema", "allowed_callers"):
        if t.get(extra):
            recorder.note(f"tools.{extra}")
    fn = {"name": name, "description": _description(t, where), "parameters": params or {}}
    return {"type": "function", "function": fn}


def _custom(t: dict[str, Any], where: str, name: str, recorder: Recorder) -> dict[str, Any]:
    """A custom (free-form input) tool: rendered as a function of one string `input`; a grammar
    format is recorded (not enforced)."""
    fmt = t.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type", "text"), str)):
        raise GatewayError(f"{where}.format must be an object with a string 'type'", param="tools")
    if fmt is not None and fmt.get("type", "text") != "text":
        recorder.note("tools.format", fmt["type"])
    fn = {"name": name, "description": _description(t, where), "parameters": CUSTOM_INPUT}
    return {"type": "function", "function": fn}


def _tools(raw: Any, recorder: Recorder, aliases: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Function and custom tools as they are; a namespace's tools under `namespace.name` (`aliases`
    maps each rendered name back to its kind, name and namespace for the answer); hosted tools
    recorded; OpenAI's own client tools refused."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise GatewayError("'tools' must be an array", param="tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(t: dict[str, Any], where: str, namespace: str | None) -> None:
        kind = t.get("type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise GatewayError(f"{where}.name must be a non-empty string", param="tools")
        name = f"{namespace}.{t['name']}" if namespace else t["name"]
        if name in seen:
            raise GatewayError(f"{where}: a second tool named {name!r}", param="tools")
        seen.add(name)
        if kind == "function":
            out.append(_function(t, where, name, recorder))
        else:
            out.append(_custom(t, where, name, recorder))
        if kind == "custom" or namespace:  # plain functions need no mapping back
            aliases[name] = (kind, t["name"], namespace)

    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        where = f"tools[{i}]"
        if not isinstance(kind, str):  # (an object or array here is no tool type, and unhashable)
            raise GatewayError(
                f"{where} must be an object whose 'type' is a string; got {t!r:.80}", param="tools"
            )
        if kind in ("function", "custom"):
            add(t, where, None)
        elif kind == "namespace":
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise GatewayError(f"{where}: a namespace needs a 'name' and 'tools'", param="tools")
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict) or sub.get("type") not in ("function", "custom"):
                    raise GatewayError(f"{where}.tools[{j}] must be a function or custom tool", param="tools")
                add(sub, f"{where}.tools[{j}]", ns)
        elif kind in HOSTED_TOOLS:
            recorder.note("tools", kind)
        elif kind in CLIENT_BUILTINS:
            raise GatewayError(
                f"{where}: {kind!r} is an OpenAI-defined tool whose call items this gateway does not write; "
                "give the agent a function tool instead",
                param="tools",
            )
        else:
            raise GatewayError(
                f"{where}: tool type {kind!r} is not known (function, custom, namespace; hosted tools are "
                "recorded)",
                param="tools",
            )
    return out or None


def _tools_of(
    raw: Any, recorder: Recorder, memo: ParseMemo | None
) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """`_tools` and its aliases, through the session's memo when there is one: the same tools as the
    last call's are not converted again (what converting them recorded is recorded again)."""

    def convert(raw: Any) -> tuple[list[dict[str, Any]] | None, dict[str, Any], list[str]]:
        own, aliases = Recorder(), {}
        return _tools(raw, own, aliases), aliases, own.notes

    tools, aliases, notes = convert(raw) if memo is None else memo.tools("responses", raw, convert)
    for note in notes:
        recorder.note(note)
    return tools, dict(aliases)


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None, recorder: Recorder) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        recorder.note("tool_choice.allowed_tools")  # every tool stays rendered; the mode is kept
        raw = raw.get("mode", "auto")
    if raw in ("auto", "none", "required"):
        if raw == "required" and not tools:
            raise GatewayError("tool_choice 'required' needs 'tools'", param="tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") in ("function", "custom"):
        name = raw.get("name")
        if not isinstance(name, str):
            raise GatewayError("tool_choice.name must be a string", param="tool_choice")
        if isinstance(raw.get("namespace"), str):
            name = f"{raw['namespace']}.{name}"
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise GatewayError(f"tool_choice names a tool not in 'tools': {name!r}", param="tool_choice")
        return "named", name
    raise GatewayError(
        "tool_choice must be 'auto', 'none', 'required', {'type': 'function' | 'custom', 'name': ...} or "
        "allowed_tools (hosted tools do not run here)",
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
    if content is None:
        return ""
    raise GatewayError("input: an item's 'content' must be a string or an array of parts", param="input")


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
            # the text as sent; else the reasoning sealed in encrypted_content (sealed.py); else
            # the summary's text
            sealed = item.get("encrypted_content")
            if sealed is not None and not isinstance(sealed, str):
                raise GatewayError(f"input[{i}].encrypted_content must be a string", param="input")
            text = _output_text(item.get("content") or [])
            text = text or unseal(sealed) or _output_text(item.get("summary") or [])
            assistant()["reasoning_content"] = text
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise GatewayError(f"input[{i}]: a {kind} needs 'name' and 'call_id'", param="input")
            name = item["name"]
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = f"{item['namespace']}.{name}"
            if kind == "function_call":
                arguments = item.get("arguments", "{}")
            else:  # a custom tool is rendered as a function of one string input (`_custom`)
                if not isinstance(item.get("input", ""), str):
                    raise GatewayError(f"input[{i}].input must be a string", param="input")
                arguments = {"input": item.get("input", "")}
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turn = None
            if not isinstance(item.get("call_id"), str):
                raise GatewayError(f"input[{i}]: a {kind} needs 'call_id'", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output")})
        else:
            raise GatewayError(
                f"input[{i}].type {kind!r} is not supported (message, reasoning, function_call, "
                "function_call_output, custom_tool_call, custom_tool_call_output: hosted tools' items "
                "and item references do not exist here)",
                param="input",
            )
    return out, turn is None


def parse(body: dict[str, Any], memo: ParseMemo | None = None) -> TurnRequest:
    """A `/responses` body -> the core's request (`memo`: the session's, see `history.py`)."""
    recorder = screen(
        body,
        RESPONSES,
        lambda key: GatewayError(f"Unknown parameter: '{key}'.", param=key),
        lambda key, why: _refuse(key, why),
    )
    params = _params(body, recorder)
    _check_text(body, recorder)
    if body.get("truncation") not in (None, "disabled", "auto"):  # auto: nothing is ever dropped here
        raise GatewayError("'truncation' must be 'auto' or 'disabled'", param="truncation")
    reasoning = _reasoning(body, recorder)
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
    tools, aliases = _tools_of(body.get("tools"), recorder, memo)
    tool_choice, named = _tool_choice(body.get("tool_choice"), tools, recorder)
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
        reasoning=reasoning,
        ignored=recorder.notes,
        shaping={
            "tools": aliases,
            "seal_reasoning": "reasoning.encrypted_content" in (body.get("include") or []),
        },
    )
