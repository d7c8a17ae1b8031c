"""The OpenAI dialect's parser: a request body -> the core's `TurnRequest` / `TextRequest`.

`parse_chat` reads `/chat/completions` bodies, `parse_completion` `/completions` bodies; both map
the sampling fields to SGLang `sampling_params` (`parse_generation`) and raise OpenAI-style errors
naming the field. Every field of the public API is in `controls.CHAT` / `controls.COMPLETIONS`
(honoured, recorded or refused, and why; docs/gateway.md prints the tables); any other top-level
key is a 400 ("Unrecognized request argument supplied: ..."), as OpenAI answers. The answers are
shaped by `openai_response.py`; `dialect.py` describes the seam.
"""

from __future__ import annotations

import json
from typing import Any

from palaestra.gateway.dialect import GenerationParams, Reasoning, TextRequest, TurnRequest
from palaestra.gateway.dialects.controls import CHAT, COMPLETIONS, Recorder, Rule, screen
from palaestra.gateway.dialects.validate import MAX_NEW_TOKENS, SEED_RANGE, number, stop_list
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import normalize_messages, normalize_tools
from palaestra.gateway.sessions.history import ParseMemo

MAX_N = 64
"""Most choices one call may ask for (`n`); more is a 400 naming `n`."""
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""Values of `reasoning_effort` (and the Responses API's `reasoning.effort`)."""


def screen_fields(body: dict[str, Any], table: dict[str, Rule]) -> Recorder:
    """The body's top-level fields against the route's table (`controls.screen`), in OpenAI's words."""
    return screen(
        body,
        table,
        lambda key: GatewayError(f"Unrecognized request argument supplied: {key}", param=key),
        lambda key, why: GatewayError(f"'{key}' is not supported: {why}", param=key),
    )


def parse_generation(body: dict[str, Any], chat: bool, recorder: Recorder | None = None) -> GenerationParams:
    """The sampling and answer fields of a chat or completions body (already screened)."""
    sampling: dict[str, Any] = {}
    temperature = number(body, "temperature", 0, 2)
    sampling["temperature"] = 1.0 if temperature is None else temperature  # OpenAI's default
    top_p = number(body, "top_p", 0, 1)
    sampling["top_p"] = 1.0 if top_p is None else max(top_p, 1e-6)
    if body.get("top_k") is not None:
        sampling["top_k"] = number(body, "top_k", -1, 1 << 30, integer=True)
    if body.get("min_p") is not None:
        sampling["min_p"] = number(body, "min_p", 0, 1)
    if body.get("repetition_penalty") is not None:
        sampling["repetition_penalty"] = number(body, "repetition_penalty", 0.01, 2)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            sampling[key] = number(body, key, -2, 2)
    if body.get("min_tokens") is not None:
        sampling["min_new_tokens"] = number(body, "min_tokens", 0, 1 << 30, integer=True)
    if body.get("ignore_eos") is not None:
        sampling["ignore_eos"] = bool(body["ignore_eos"])
    seed = number(body, "seed", *SEED_RANGE, integer=True)
    if seed is not None:
        sampling["sampling_seed"] = seed
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise GatewayError("'logit_bias' must be an object {token_id: bias}", param="logit_bias")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()):
            raise GatewayError("'logit_bias' values must be numbers", param="logit_bias")
        sampling["logit_bias"] = {str(k): float(v) for k, v in bias.items()}
    max_field = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    # a max_tokens past the context is clamped, or refused with max_tokens_over_context=reject, by
    # the service (the same for every dialect)
    max_tokens = number(body, max_field, 1, MAX_NEW_TOKENS, integer=True)
    stops = stop_list(body, "stop", one_string=True)
    if stops:
        sampling["stop"] = stops
    n = number(body, "n", 1, MAX_N, integer=True) or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError("'stream' must be a boolean", param="stream")
    if stream and n > 1:
        raise GatewayError("streaming supports n = 1 only", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise GatewayError("'stream_options' must be an object", param="stream_options")
    if options.get("include_obfuscation") and recorder is not None:
        recorder.note("stream_options.include_obfuscation")  # nothing to obfuscate
    logprobs_raw = body.get("logprobs")
    if chat:
        logprobs = bool(logprobs_raw)
        top = number(body, "top_logprobs", 0, 20, integer=True) or 0
        if top and not logprobs:
            raise GatewayError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    else:  # completions: logprobs is an integer count of alternatives
        top = number(body, "logprobs", 0, 5, integer=True) or 0
        logprobs = logprobs_raw is not None
    if n > 1:
        sampling["n"] = n
    return GenerationParams(
        sampling, n, stream, bool(options.get("include_usage")), logprobs, top, stops, max_tokens, max_field
    )


def constraint(fmt: Any, param: str) -> dict[str, str]:
    """An OpenAI output format (chat `response_format`, Responses `text.format`) -> SGLang's
    constrained-decoding sampling field: json_object -> any JSON object, json_schema -> that schema
    (both `json_schema`, a JSON-schema string), text -> nothing."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        # chat nests the schema under "json_schema"; the Responses API puts it on the format itself
        spec = fmt.get("json_schema", fmt)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GatewayError(f"'{param}' of type json_schema needs a 'schema' object", param=param)
        return {"json_schema": json.dumps(schema)}
    raise GatewayError(
        f"'{param}' must be of type text, json_object or json_schema; got {kind!r}", param=param
    )


def constraints(body: dict[str, Any], fmt: Any, param: str) -> dict[str, str]:
    """All output constraints of a request: its format and SGLang's `regex` / `ebnf` extensions
    (at most one: the engine applies one grammar)."""
    out = constraint(fmt, param)
    for key in ("regex", "ebnf"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise GatewayError(f"'{key}' must be a non-empty string", param=key)
        out[key] = value
    if len(out) > 1:
        raise GatewayError(f"only one of {param}, 'regex' and 'ebnf' may constrain the output", param=param)
    return out


def _as_is(messages: list[Any], start: int) -> tuple[list[Any], bool]:
    return messages, True


def parse_chat(body: dict[str, Any], memo: ParseMemo | None = None) -> TurnRequest:
    """A `/chat/completions` body -> the core's request (`memo`: the session's, see `history.py`)."""
    recorder = screen_fields(body, CHAT)
    params = parse_generation(body, True, recorder)
    params.sampling.update(constraints(body, body.get("response_format"), "response_format"))
    raw, raw_tools = body.get("messages"), body.get("tools")
    if memo is None or not isinstance(raw, list) or not raw:
        messages = normalize_messages(raw)
    else:
        messages = memo.history("chat", raw, _as_is, 0)
    tools = normalize_tools(raw_tools) if memo is None else memo.tools("chat", raw_tools, normalize_tools)
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    named = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise GatewayError(
                "tool_choice must name a function: {'function': {'name': ...}}", param="tool_choice"
            )
        if not tools or named not in {t["function"]["name"] for t in tools}:
            raise GatewayError(f"tool_choice names a function not in 'tools': {named!r}", param="tool_choice")
        tool_choice = "named"
    elif tool_choice not in ("auto", "none", "required"):
        raise GatewayError(
            "tool_choice must be 'auto', 'none', 'required' or a named function", param="tool_choice"
        )
    if tool_choice == "required" and not tools:
        raise GatewayError("tool_choice 'required' needs 'tools'", param="tool_choice")
    extra = body.get("chat_template_kwargs") or None
    if extra is not None and not isinstance(extra, dict):
        raise GatewayError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise GatewayError(
            f"'reasoning_effort' must be one of {', '.join(EFFORTS)}", param="reasoning_effort"
        )
    return TurnRequest(
        messages,
        tools,
        tool_choice,
        params,
        named_tool=named,
        template_kwargs=extra,
        reasoning=None if effort is None else Reasoning(effort != "none", effort, "reasoning_effort"),
        ignored=recorder.notes,
    )


def parse_completion(body: dict[str, Any]) -> TextRequest:
    """A `/completions` body -> the core's request. Streaming is served on chat only."""
    screen_fields(body, COMPLETIONS)  # the recorded ones are not kept: a text turn has no controls
    params = parse_generation(body, False)
    if params.stream:
        raise GatewayError("streaming is supported on /chat/completions only", param="stream")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise GatewayError("'prompt' must be a non-empty string", param="prompt")
    return TextRequest(prompt, params)
