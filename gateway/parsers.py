"""Output parsers: a model's raw output text -> OpenAI message parts (content, reasoning, tool calls).

The input is the text of the sampled ids decoded with ``skip_special_tokens=False``, with the final
stop token (``<|im_end|>``, ``<|observation|>``, ...) removed. Parsing never raises on model output:
a tool call that cannot be parsed stays in ``content`` and is described in ``parse_errors``.

Model families (the names follow SGLang/vLLM's ``--tool-call-parser``/``--reasoning-parser``):

=============  ==================================================================================
``hermes``     Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
               calls separated by ``\\n``.
``glm45``      GLM-4.5 / 4.6 / 4.7 / 5: ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...``
               ``</tool_call>``, no separator between calls (GLM-4.5 put ``\\n`` after the name and
               around each pair; both are accepted). ``V`` is the raw string for string values and
               JSON for anything else, so a value is decoded as JSON unless the request's tool
               schema says the parameter is a string (then it stays the raw text); without a
               schema, text that is valid JSON is decoded and anything else stays a string.
``none``       no tool calls: all text is content.
=============  ==================================================================================

Reasoning parsers split a ``<think>...</think>`` block off the front: ``qwen3`` and ``deepseek-r1``
(whitespace next to the tags is ``\\n``, stripped as the templates strip it) and ``glm45`` (any
whitespace, stripped). The opening tag is optional, because templates may put it in the
generation prompt (GLM-5 ends its prompt with ``<|assistant|><think>``, DeepSeek-R1 with
``<think>\\n``): text of the form ``...</think>rest`` is reasoning up to the tag. Text that opens
``<think>`` and never closes it (cut off by ``max_tokens``) is all reasoning. A model whose prompt
opened the block and that was cut off before ``</think>`` cannot be told apart from plain content
by the text alone; it is returned as content.

Decisions:

* A call of a tool that is not in the request's ``tools`` is still returned as a tool call, with a
  note in ``parse_errors``: the model did try to call it, an agent loop answers such a call with
  an error tool message (the learning signal), and turning it into text would make the assistant
  message differ from what the model produced.
* When calls were parsed, the remaining content is stripped of surrounding whitespace, because the
  templates put their own separators around calls (Qwen ``content + "\\n" + call``; GLM strips
  content); without calls the content is returned unchanged.
* Empty reasoning (``<think>\\n\\n</think>``) is reported as ``reasoning_content=None``.

Plug-ins: ``get_tool_parser("pkg.module:attr")`` imports ``pkg.module`` and calls ``attr()`` with no
arguments (a class or a factory); the result must have ``name``, ``start_marker`` and
``parse(text, seed, tools=None)`` as `ToolCallParser` documents. Reasoning parsers likewise, with
``name`` and ``split(text)``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from palaestra.plugins import load_object

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedOutput",
    "ReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "PARSE_ERROR_REASONS",
    "call_id",
    "error_reason",
    "detect_parsers",
    "get_reasoning_parser",
    "get_tool_parser",
    "parse_output",
    "render_tool_call_text",
]

Tools = Sequence[Mapping[str, Any]]  # the request's `tools`, OpenAI format


@dataclass
class ToolCall:
    """One OpenAI tool call (``type`` is always ``"function"``)."""

    id: str
    """``call_`` + 24 hex characters, deterministic in (seed, index): see `call_id`."""
    name: str
    arguments: str
    """The arguments object as JSON text, ``json.dumps(obj, ensure_ascii=False)``."""

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedOutput:
    content: str | None
    """The text that is neither reasoning nor a parsed call; None when empty and there are calls."""
    reasoning_content: str | None
    """The think block's text, or None when the model produced none (or an empty one)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    """What could not be parsed (that text stayed in content) and calls of unknown tools."""


@runtime_checkable
class ToolCallParser(Protocol):
    name: str
    start_marker: str
    """Text that begins a tool call: a streaming response holds content back from here on.
    Empty for a parser that never finds calls (``none``): then nothing is held back."""

    def parse(
        self, text: str, seed: str, tools: Tools | None = None
    ) -> tuple[str, list[ToolCall], list[str]]:
        """Returns (remaining content, calls, errors). ``tools`` (the request's) may refine
        argument types; call ids come from ``call_id(seed, index)``. Must not raise."""
        ...


@runtime_checkable
class ReasoningParser(Protocol):
    name: str

    def split(self, text: str) -> tuple[str | None, str]:
        """Returns (reasoning or None, the rest of the text)."""
        ...


def call_id(seed: str, index: int) -> str:
    """A tool-call id that is the same whenever the same output is parsed with the same seed."""
    digest = hashlib.sha256(f"{seed}\x1f{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_schema(tools: Tools | None, name: str) -> Mapping[str, Any] | None:
    """The ``parameters`` schema of tool ``name`` in an OpenAI ``tools`` list, if there is one."""
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            return parameters if isinstance(parameters, Mapping) else None
    return None


def _is_string_param(schema: Mapping[str, Any] | None, key: str) -> bool:
    properties = schema.get("properties") if schema else None
    spec = properties.get(key) if isinstance(properties, Mapping) else None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if isinstance(kind, list):  # ["string", "null"] is a string that may be absent
        kind = [k for k in kind if k != "null"]
        kind = kind[0] if len(kind) == 1 else None
    return kind == "string"


def _finish(pieces: list[str], calls: list[ToolCall]) -> str:
    """Join the text outside parsed calls; strip it when calls were cut out (see module docs)."""
    text = "".join(pieces)
    return text.strip() if calls else text


# ----------------------------------------------------------------------------------------------
# Tool-call parsers


class NoToolParser:
    """Never finds a call: everything is content."""

    name = "none"
    start_marker = ""

    def parse(
        self, text: str, seed: str, tools: Tools | None = None
    ) -> tuple[str, list[ToolCall], list[str]]:
        return text, [], []


class HermesToolParser:
    """Qwen2.5 / Qwen3 (Hermes format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    A last ``<tool_call>`` that is never closed is still a call if its JSON is complete (the
    model stopped right after it); an incomplete one is an error like any malformed call.
    """

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(
        self, text: str, seed: str, tools: Tools | None = None
    ) -> tuple[str, list[ToolCall], list[str]]:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        end = 0
        for match in self._CALL.finditer(text):
            result = self._call(match.group(1))
            if isinstance(result, str):
                errors.append(f"malformed tool call JSON at char {match.start()}: {result}")
                continue  # the call's text stays in content
            name, arguments = result
            pieces.append(text[end : match.start()])
            end = match.end()
            calls.append(ToolCall(call_id(seed, len(calls)), name, _dumps(arguments)))
        pieces.append(text[end:])
        return _finish(pieces, calls), calls, errors

    @staticmethod
    def _call(body: str) -> tuple[str, dict[str, Any]] | str:
        """(name, arguments) or the reason the body is not a call."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as error:
            return error.msg + f" (line {error.lineno} column {error.colno} of the call)"
        except RecursionError:
            return "nested too deeply"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return 'not a JSON object with a string "name"'
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode the arguments
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return '"arguments" is a string that is not JSON'
        if not isinstance(arguments, dict):
            return '"arguments" is not a JSON object'
        return obj["name"], arguments


class Glm45ToolParser:
    """GLM-4.5 ... GLM-5: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``.

    GLM-5's template renders a value as ``V`` itself when it is a string and as JSON otherwise;
    the parser undoes that with the tool's schema (a ``"type": "string"`` parameter keeps the raw
    text) and falls back to "valid JSON is decoded, anything else is a string". A call must be
    closed: an unclosed one may be missing arguments.
    """

    name = "glm45"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
    _NAME = re.compile(r"[^\s<>]+")

    def parse(
        self, text: str, seed: str, tools: Tools | None = None
    ) -> tuple[str, list[ToolCall], list[str]]:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        end = 0
        for match in self._CALL.finditer(text):
            result = self._call(match.group(1), tools)
            if isinstance(result, str):
                errors.append(f"malformed tool call at char {match.start()}: {result}")
                continue
            name, arguments = result
            pieces.append(text[end : match.start()])
            end = match.end()
            calls.append(ToolCall(call_id(seed, len(calls)), name, _dumps(arguments)))
        opened = text.rfind(self.start_marker)
        if opened >= end and "</tool_call>" not in text[opened:]:
            errors.append(f"unterminated tool call at char {opened}")
        pieces.append(text[end:])
        return _finish(pieces, calls), calls, errors

    def _call(self, body: str, tools: Tools | None) -> tuple[str, dict[str, Any]] | str:
        head, marker, rest = body.partition("<arg_key>")
        name = head.strip()
        if not self._NAME.fullmatch(name):
            return f"bad function name {name!r}"
        schema = _tool_schema(tools, name)
        arguments: dict[str, Any] = {}
        position, rest = 0, marker + rest
        while position < len(rest):
            pair = self._PAIR.match(rest, position)
            if pair is None:
                return (
                    f"expected <arg_key>...</arg_key><arg_value>...</arg_value> at {rest[position:][:40]!r}"
                )
            key, raw = pair.group(1).strip(), pair.group(2)
            arguments[key] = raw if _is_string_param(schema, key) else _json_or_string(raw)
            position = pair.end()
        return name, arguments


def _json_or_string(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw


# ----------------------------------------------------------------------------------------------
# Reasoning parsers


class ThinkReasoningParser:
    """A leading ``<think>...</think>`` block, the opening tag optional (see the module docs).

    ``strip`` is the whitespace the family's template strips next to the tags: ``"\\n"`` for
    Qwen3/DeepSeek-R1, None (all whitespace) for GLM.
    """

    def __init__(self, name: str, strip: str | None):
        self.name = name
        self._strip = strip

    def split(self, text: str) -> tuple[str | None, str]:
        head, closed, rest = text.partition("</think>")
        if closed:
            # The templates take what follows the last <think> as reasoning and drop what is
            # before it; we keep such text (rare: the block should open the output) as content.
            before, _, reasoning = head.rpartition("<think>")
            content = rest.lstrip(self._strip)
            return reasoning.strip(self._strip), f"{before}{content}" if before.strip() else content
        opened = text.lstrip()
        if opened.startswith("<think>"):  # never closed: cut off while thinking
            return opened[len("<think>") :].strip(self._strip), ""
        return None, text


# ----------------------------------------------------------------------------------------------
# Lookup by name or import path, and detection from a chat template

TOOL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "glm45": Glm45ToolParser,
    "none": NoToolParser,
}
REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "qwen3": lambda: ThinkReasoningParser("qwen3", "\n"),
    "deepseek-r1": lambda: ThinkReasoningParser("deepseek-r1", "\n"),
    "glm45": lambda: ThinkReasoningParser("glm45", None),
}


def _plugin(path: str, kind: str, protocol: type) -> Any:
    parser = load_object(path, f"{kind} parser", callable_=True)()
    if not isinstance(parser, protocol):
        raise ValueError(
            f"{kind} parser {path!r} made {parser!r}, which lacks what {protocol.__name__} needs"
        )
    return parser


def get_tool_parser(name: str) -> ToolCallParser:
    """A tool-call parser by name (`TOOL_PARSERS`) or import path ``"pkg.module:attr"``."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]()
    if ":" in name:
        return _plugin(name, "tool-call", ToolCallParser)
    raise ValueError(
        f"unknown tool-call parser {name!r}: use one of {sorted(TOOL_PARSERS)} or 'pkg.module:attr'"
    )


def get_reasoning_parser(name: str) -> ReasoningParser | None:
    """A reasoning parser by name (`REASONING_PARSERS`) or import path; None for ``"none"``."""
    if name == "none":
        return None
    if name in REASONING_PARSERS:
        return REASONING_PARSERS[name]()
    if ":" in name:
        return _plugin(name, "reasoning", ReasoningParser)
    known = sorted([*REASONING_PARSERS, "none"])
    raise ValueError(f"unknown reasoning parser {name!r}: use one of {known} or 'pkg.module:attr'")


# Qwen's templates write the call literally: '<tool_call>\n{"name": ' (escaped inside a Jinja or
# JSON string literal, so the newline and quotes may appear as \n and \").
_HERMES_MARK = re.compile(r'<tool_call>(?:\\n|\n)\{\\?"name\\?"')


def detect_parsers(chat_template: str) -> tuple[str, str]:
    """(tool parser, reasoning parser) for a chat template, from markers only that family writes.

    * ``glm45`` tools: the template mentions ``<arg_key>`` (GLM-4.5 and later).
    * ``hermes`` tools: the template writes ``<tool_call>`` followed by a JSON object starting
      with ``"name"`` (Qwen2.5, Qwen3, QwQ) -- Qwen3.5's ``<function=...>`` format is not Hermes.
    * ``glm45`` reasoning: ``</think>`` with GLM's ``<|assistant|>`` role token.
    * ``qwen3`` reasoning: ``</think>`` with ChatML's ``<|im_start|>``.
    * ``deepseek-r1`` reasoning: ``</think>`` with DeepSeek's ``<｜Assistant｜>``.

    Anything else is ``"none"``: better no parsing than a wrong one.
    """
    tool = "none"
    if "<arg_key>" in chat_template and "<tool_call>" in chat_template:
        tool = "glm45"
    elif _HERMES_MARK.search(chat_template) and "<function=" not in chat_template:
        tool = "hermes"
    reasoning = "none"
    if "</think>" in chat_template:
        if "<|assistant|>" in chat_template:
            reasoning = "glm45"
        elif "<|im_start|>" in chat_template:
            reasoning = "qwen3"
        elif "<｜Assistant｜>" in chat_template:
            reasoning = "deepseek-r1"
    return tool, reasoning


# ----------------------------------------------------------------------------------------------
# Putting it together

PARSE_ERROR_REASONS = ("malformed_json", "malformed_call", "unterminated", "unknown_tool", "parser_failed")
"""Why part of an output did not parse (metric labels; `error_reason` classifies a message)."""


def error_reason(message: str) -> str:
    """The reason (one of `PARSE_ERROR_REASONS`) of a `parse_errors` message."""
    if "malformed tool call JSON" in message or "is a string that is not JSON" in message:
        return "malformed_json"
    if "unterminated" in message:
        return "unterminated"
    if "not in the request's tools" in message:
        return "unknown_tool"
    if "parser" in message and "failed" in message:
        return "parser_failed"
    return "malformed_call"


def parse_output(
    text: str,
    tool_parser: ToolCallParser | None,
    reasoning_parser: ReasoningParser | None,
    seed: str,
    tools_enabled: bool,
    tools: Tools | None = None,
) -> ParsedOutput:
    """Split reasoning off, then (if ``tools_enabled``) parse tool calls out of the rest.

    ``seed`` makes call ids deterministic (use something unique per turn, e.g. session and turn
    index). ``tools`` is the request's tool list: with it, argument types follow the schemas and
    calls of tools not in the list are noted in ``parse_errors`` (they are still returned).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    reasoning, rest = None, text
    if reasoning_parser is not None:
        try:
            reasoning, rest = reasoning_parser.split(text)
        except Exception as error:  # a plug-in's bug must not fail the request: keep the text
            errors.append(f"reasoning parser {reasoning_parser.name!r} failed: {error!r}")
    content = rest
    if tools_enabled and tool_parser is not None:
        try:
            content, calls, parser_errors = tool_parser.parse(rest, seed, tools)
        except Exception as error:  # likewise: the text stays content
            content, parser_errors = rest, [f"tool-call parser {tool_parser.name!r} failed: {error!r}"]
        errors += parser_errors
        if tools is not None and calls:
            known = _tool_names(tools)
            errors += [
                f"tool call {i} names {call.name!r}, which is not in the request's tools; returned as a call"
                for i, call in enumerate(calls)
                if call.name not in known
            ]
    return ParsedOutput(
        content=content if content or not calls else None,
        reasoning_content=reasoning or None,
        tool_calls=calls,
        parse_errors=errors,
    )


_last_names: tuple[object, frozenset[str | None]] = (None, frozenset())


def _tool_names(tools: Tools) -> frozenset[str | None]:
    """The names of `tools`, kept for the last list asked about: a session's parse memo hands the
    same list to each call whose tools are the same, and ~30 tools' names cost more than the parse."""
    global _last_names
    if _last_names[0] is not tools:
        _last_names = (tools, frozenset(_tool_name(tool) for tool in tools))
    return _last_names[1]


def _tool_name(tool: object) -> str | None:
    function = tool.get("function", tool) if isinstance(tool, Mapping) else None
    return function.get("name") if isinstance(function, Mapping) else None


def render_tool_call_text(parser_name: str, name: str, arguments_json: str) -> str:
    """How a model of that family writes one call, exactly as its chat template renders it.

    Consecutive calls are joined with ``"\\n"`` for ``hermes`` and with nothing for ``glm45``;
    content before the calls is followed by ``"\\n"`` (hermes) or nothing (glm45).
    """
    arguments = json.loads(arguments_json)
    if not isinstance(arguments, dict):
        raise ValueError(f"tool arguments must be a JSON object, got {arguments_json!r}")
    if parser_name == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {_dumps(arguments)}}}\n</tool_call>'
    if parser_name == "glm45":
        pairs = "".join(
            f"<arg_key>{key}</arg_key><arg_value>{value if isinstance(value, str) else _dumps(value)}</arg_value>"
            for key, value in arguments.items()
        )
        return f"<tool_call>{name}{pairs}</tool_call>"
    raise ValueError(f"no tool-call rendering for parser {parser_name!r} (known: hermes, glm45)")
