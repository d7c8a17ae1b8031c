"""Every request field of the public APIs, per dialect: honoured, recorded, or refused — and why.

A coding-agent harness sends what its vendor's API takes: cache keys, client metadata, beta flags,
hosted tools, effort levels. The gateway serves an open model through its chat template, so each
field of the live OpenAI Chat Completions, OpenAI Responses and Anthropic Messages APIs (as the
pinned `openai` and `anthropic` SDKs declare them) is one of:

* **honoured**: it changes what the model sees or how it samples, as upstream (or as closely as an
  open model can: a thinking ask becomes the template's switch, `template_caps.py`);
* **recorded**: nothing here can act on it and dropping it changes neither what the model sees nor
  what is trained on (a cache key, billing, a hosted tool that cannot run here): the call is
  served, and the field is counted on the turn (`Turn.controls["ignored"]`), per session
  (`ignored_controls` in GET /sessions/{id}) and in `palaestra_gateway_ignored_controls_total`;
* **refused**: acting on it is impossible and ignoring it would silently change the conversation
  (a server-held thread, a stored prompt): a 400 naming the field, in the dialect's envelope.

A top-level field in no table is a field no public API has, and stays a 400 as before. `screen`
applies a table to a body; the parsers add what they find inside honoured fields (a `reasoning`
summary, a hosted tool, a beta flag) with `Recorder.note`. `resolve` then fits the request to the
template (`template_caps.TemplateCaps`): the reasoning ask onto its switch, system messages after
the first where the template lets them stand. docs/gateway.md prints these tables
(tests/gateway/test_controls.py keeps the two in step, and every SDK field in a table).

A recorded control is a name (`client_metadata`, `reasoning.summary`, `tools[web_search]`), or a
name and a value (`anthropic-beta=context-management-2025-06-27`); the metric is labelled by the
name only, so a client cannot grow its label set. Each call counts a control once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from palaestra.gateway.dialect import TurnRequest
from palaestra.gateway.dialects.template_caps import TemplateCaps
from palaestra.gateway.errors import GatewayError

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MAX_NOTES",
    "MESSAGES",
    "RESPONSES",
    "TABLES",
    "Recorder",
    "markdown",
    "Rule",
    "resolve",
    "screen",
]

Treatment = Literal["honoured", "recorded", "refused"]

MAX_NOTES = 64
"""Most distinct controls one call records (a client sending hundreds of beta flags gets the first)."""
MAX_VALUE_CHARS = 80
"""A recorded value longer than this is cut (flags and tool types are short)."""


@dataclass(frozen=True)
class Rule:
    """How one top-level field is treated."""

    treatment: Treatment
    why: str
    noop: tuple[Any, ...] = ()
    """Values that ask for nothing (`parallel_tool_calls: true`, `background: false`): neither
    recorded nor refused."""


def _h(why: str) -> Rule:
    return Rule("honoured", why)


def _r(why: str, *noop: Any) -> Rule:
    return Rule("recorded", why, noop)


def _x(why: str, *noop: Any) -> Rule:
    return Rule("refused", why, noop)


_SGLANG = {
    "top_k": _h("SGLang sampling extension"),
    "min_p": _h("SGLang sampling extension"),
    "repetition_penalty": _h("SGLang sampling extension"),
    "regex": _h("SGLang constrained decoding (one constraint per call)"),
    "ebnf": _h("SGLang constrained decoding (one constraint per call)"),
    "chat_template_kwargs": _h("extra chat-template variables; they win over a mapped thinking ask"),
}
_CACHE_WHY = "the engines cache every prefix by themselves; there is no cache to key or configure"
_ACCOUNT_WHY = "about the vendor's accounts, routing or policies; nothing to do for a local model"

_OPENAI_COMMON = {
    "model": _h("accepted whatever it names: the gateway serves one model, and its answers name it"),
    "temperature": _h("sampling"),
    "top_p": _h("sampling"),
    "stream": _h("server-sent events"),
    "metadata": _r("kept by OpenAI with the object; the gateway keeps the trajectory instead"),
    "store": _r("the gateway keeps every turn in the session's trajectory anyway"),
    "service_tier": _r(_ACCOUNT_WHY),
    "user": _r(_ACCOUNT_WHY),
    "safety_identifier": _r(_ACCOUNT_WHY),
    "moderation": _r("no moderation model runs here"),
    "prompt_cache_key": _r(_CACHE_WHY),
    "prompt_cache_retention": _r(_CACHE_WHY),
    "prompt_cache_options": _r(_CACHE_WHY),
}

CHAT: dict[str, Rule] = {
    **_OPENAI_COMMON,
    **_SGLANG,
    "messages": _h("rendered with the model's chat template"),
    "max_tokens": _h("the turn's budget; clamped to the context by default (option max_tokens_over_context)"),
    "max_completion_tokens": _h("as max_tokens"),
    "stop": _h("stop strings"),
    "seed": _h("sampling_seed"),
    "n": _h("choices (non-streaming)"),
    "logprobs": _h("the engine's logprobs of the sampled tokens"),
    "top_logprobs": _h("alternatives per token"),
    "stream_options": _h("include_usage; include_obfuscation is recorded"),
    "presence_penalty": _h("sampling"),
    "frequency_penalty": _h("sampling"),
    "logit_bias": _h("sampling (token id -> bias)"),
    "tools": _h("function tools, rendered by the template"),
    "tool_choice": _h("none stops parsing; auto/required/named are rendered and parsed, not forced"),
    "response_format": _h("constrained decoding (json_object, json_schema)"),
    "reasoning_effort": _h("the template's thinking switch (template_caps.py); recorded without one"),
    "min_tokens": _h("SGLang min_new_tokens"),
    "ignore_eos": _h("SGLang sampling extension"),
    "parallel_tool_calls": _r("every call the model writes is returned", True),
    "modalities": _r("text is the only output", ["text"]),
    "audio": _r("no audio is produced"),
    "prediction": _r("predicted outputs only speed up a vendor's decoding"),
    "verbosity": _r("not a control an open model has"),
    "web_search_options": _r("no web search runs here: the model answers without it"),
    "skip_special_tokens": _r("the answer never holds special tokens; the trajectory keeps every id"),
    "separate_reasoning": _r("reasoning is always separated when the template has a parser", True),
    "functions": _x("deprecated: send the same definitions as 'tools' (answers carry tool_calls)"),
    "function_call": _x("deprecated: send 'tool_choice' with 'tools'"),
}

COMPLETIONS: dict[str, Rule] = {
    **_OPENAI_COMMON,
    **{k: v for k, v in CHAT.items() if k in ("max_tokens", "stop", "seed", "n", "presence_penalty")},
    **{k: v for k, v in CHAT.items() if k in ("frequency_penalty", "logit_bias", "top_k", "min_p")},
    **{k: v for k, v in CHAT.items() if k in ("repetition_penalty", "min_tokens", "ignore_eos")},
    "prompt": _h("the raw text prompt (no template)"),
    "logprobs": _h("an integer: alternatives per token"),
    "stream": _x("streaming is served on /chat/completions", False),
    "stream_options": _r("no stream on this route"),
    "echo": _r("the prompt is not echoed back", False),
    "suffix": _r("no fill-in-the-middle"),
    "best_of": _r("one sample per choice", 1),
    "skip_special_tokens": CHAT["skip_special_tokens"],
}

_HOSTED_WHY = "a hosted tool that cannot run here: not shown to the model"

RESPONSES: dict[str, Rule] = {
    **_OPENAI_COMMON,
    **_SGLANG,
    "seed": _h("SGLang sampling_seed (extension)"),
    "stop": _h("stop strings (extension)"),
    "input": _h("items rendered with the chat template (responses_api.py)"),
    "instructions": _h("a leading system message, not carried by previous_response_id"),
    "tools": _h("function, namespace and custom tools; hosted ones are recorded"),
    "tool_choice": _h("as chat"),
    "max_output_tokens": _h("the turn's budget; clamped to the context by default"),
    "top_logprobs": _h("with include message.output_text.logprobs"),
    "previous_response_id": _h("the session's kept conversation goes before input"),
    "store": _h("keeps the conversation for previous_response_id (default true)"),
    "metadata": _h("echoed in the response"),
    "include": _h("logprobs and reasoning.encrypted_content; hosted tools' outputs are recorded"),
    "text": _h("format is constrained decoding; verbosity is recorded"),
    "reasoning": _h("effort -> the template's thinking switch; summary is recorded"),
    "truncation": _h("disabled; auto is accepted: nothing is dropped, an overflow is a 400"),
    "parallel_tool_calls": _r("every call the model writes is returned", True),
    "stream_options": _r("include_obfuscation: nothing to obfuscate"),
    "max_tool_calls": _r("limits hosted tool calls, and none run here"),
    "client_metadata": _r("sent by Codex for the vendor's logs; nothing to do here"),
    "context_management": _r("server-side compaction: the model sees the whole input as sent"),
    "image": _r("no image is produced"),
    "access_programs": _r(_ACCOUNT_WHY),
    "background_options": _r("only with background, which is refused"),
    "background": _x("no background mode: the answer comes on the call", False),
    "conversation": _x("no server-held conversations; use previous_response_id or send the input"),
    "prompt": _x("no stored prompts: the model would not see what the prompt id names"),
}

MESSAGES: dict[str, Rule] = {
    "model": _OPENAI_COMMON["model"],
    "messages": _h("user/assistant (and system) messages, rendered with the chat template"),
    "system": _h("a leading system message"),
    "max_tokens": _h("required, as upstream; clamped to the context by default"),
    "stop_sequences": _h("stop strings"),
    "temperature": _h("sampling (0-1; older SDKs send it)"),
    "top_p": _h("sampling"),
    "top_k": _h("sampling"),
    "stream": _h("server-sent events"),
    "tools": _h("client tools and bash/text_editor; server tools are recorded"),
    "tool_choice": _h("auto/any/tool/none; disable_parallel_tool_use is recorded"),
    "thinking": _h("enabled/adaptive/disabled -> the template's thinking switch"),
    "output_config": _h("effort -> the thinking switch; format -> constrained decoding"),
    "metadata": _r("user_id for the vendor's abuse checks; nothing to do here"),
    "service_tier": _r(_ACCOUNT_WHY),
    "cache_control": _r(_CACHE_WHY),
    "container": _r("a code-execution container for server tools, which are not run here"),
    "context_management": _r("server-side context edits: the model sees the messages as sent"),
    "mcp_servers": _r("remote MCP servers are hosted tools: not connected, not shown to the model"),
    "inference_geo": _r(_ACCOUNT_WHY),
    "speed": _r("a vendor's serving mode"),
    "diagnostics": _r("about the vendor's prompt cache"),
    "user_profile_id": _r(_ACCOUNT_WHY),
    "workspace_id": _r(_ACCOUNT_WHY),
    "billing_policy": _r(_ACCOUNT_WHY),
    "fallbacks": _r("there is one model: no substitute to retry on"),
    "fallback_credit_token": _r(_ACCOUNT_WHY),
    "betas": _r("beta flags (also sent as the anthropic-beta header, recorded per flag)"),
    "compaction": _x("a compaction request answers with a summary block the gateway cannot write"),
    "thread": _x("no server-held threads: send the whole conversation"),
}

TABLES: dict[str, dict[str, Rule]] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "messages": MESSAGES,
}
"""Each route's table, by the route names the metrics use."""


def markdown(route: str) -> str:
    """`TABLES[route]` as the Markdown table docs/gateway.md prints (field, treatment, why)."""
    rows = ["| field | treatment | why |", "|---|---|---|"]
    for key, rule in sorted(TABLES[route].items()):
        noop = f" (no-op values accepted: {', '.join(repr(v) for v in rule.noop)})" if rule.noop else ""
        rows.append(f"| `{key}` | {rule.treatment} | {rule.why.replace('|', '/')}{noop} |")
    return "\n".join(rows)


class Recorder:
    """The controls one call records, in order, each once (at most `MAX_NOTES`)."""

    __slots__ = ("notes",)

    def __init__(self, notes: Iterable[str] = ()) -> None:
        self.notes: list[str] = []
        for n in notes:
            self.note(n)

    def note(self, name: str, value: Any = None) -> None:
        entry = name if value is None else f"{name}={str(value)[:MAX_VALUE_CHARS]}"
        if entry not in self.notes and len(self.notes) < MAX_NOTES:
            self.notes.append(entry)


def screen(
    body: dict[str, Any],
    table: dict[str, Rule],
    unknown: Callable[[str], GatewayError],
    refuse: Callable[[str, str], GatewayError],
) -> Recorder:
    """Checks a body's top-level fields against `table`: a field in no table is `unknown(name)`, a
    refused one (with a value other than its no-op ones, and not null) is `refuse(name, why)`;
    returns the recorded ones present."""
    extra = [k for k in body if k not in table]
    if extra:
        raise unknown(sorted(extra)[0])
    recorder = Recorder()
    for key, value in body.items():
        rule = table[key]
        if rule.treatment == "honoured" or value is None or value in rule.noop:
            continue
        if rule.treatment == "refused":
            raise refuse(key, rule.why)
        recorder.note(key)
    return recorder


# -- fitting a request to the template --------------------------------------------------------------
def resolve(request: TurnRequest, caps: TemplateCaps) -> None:
    """Fits `request` to the template (module docstring): sets the thinking variable from
    `request.reasoning`, and places system messages after the first as `caps.mid_system` says;
    what could not be honoured is added to `request.ignored`."""
    ask = request.reasoning
    if ask is not None:
        kwargs = dict(request.template_kwargs or {})
        if caps.switch is None:
            request.ignored.append(ask.field)  # the chat template has no thinking switch
        elif caps.switch not in kwargs:  # an explicit chat_template_kwargs wins
            mapped = caps.thinking_kwargs(ask.on, ask.effort)
            if mapped:
                kwargs.update(mapped)
                request.template_kwargs = kwargs
            if not ask.on and caps.switch == "reasoning_effort":
                request.ignored.append(f"{ask.field}=off")  # harmony's least effort is "low"
    if caps.mid_system != "as_is" and any(m["role"] == "system" for m in request.messages[1:]):
        if caps.mid_system == "as_user":
            request.messages = [request.messages[0]] + [
                {"role": "user", "content": m["content"]} if m["role"] == "system" else m
                for m in request.messages[1:]
            ]
            request.ignored.append("mid_system=as_user")
        # "refuse": left as it is, for the template's own 400 naming the message
