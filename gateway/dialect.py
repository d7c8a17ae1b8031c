"""The seam between an API dialect and the gateway's one turn core.

A *dialect* is a wire format agents use to talk to the gateway. Three are served, on the same
renderer, bridge and trajectory: OpenAI Chat Completions (`/v1/chat/completions`, plus the legacy
text `/v1/completions`; `openai_request.py` / `openai_response.py`), the OpenAI Responses API
(`/v1/responses`; `responses_api.py` + `responses_answer.py`) and Anthropic Messages (`/v1/messages`; `anthropic_api.py`). A dialect is two halves and nothing else:

* a **parser**: its request body -> `TurnRequest` (or `TextRequest` for a raw text prompt). It
  validates every field and raises `GatewayError` naming the field; messages leave it in the
  gateway's internal form (OpenAI-shaped chat messages as `renderer.normalize_messages` returns
  them), tools as `renderer.normalize_tools` returns them, sampling as SGLang `sampling_params`.
  `openai_request.py` is the OpenAI one. A parser may take the session's `history.ParseMemo` as
  a second argument (`Dialect.takes_memo`), to convert only the items a call adds to its history.
* a **shaper**: `TurnResult` -> its answer body, and for `stream: true` the core's `StreamEvent`s
  -> its server-sent-event text. `openai_response.py` is the OpenAI one.

The core (`service.GatewayService`: plan -> generate -> record, and the reward that finishes a
session) sees neither the raw body nor the answer format, and a shaper never reads the raw body:
whatever an answer needs from the request (were logprobs asked for, does the stream end with a
usage event, fields the dialect echoes back) the parser puts on the request record (`params`,
`echo`). `Dialect` binds the halves; `routes.py` binds a dialect to its HTTP path.

Two rules a new dialect must keep:

* **Replies come back unchanged.** The agent sends the model's reply back in its own dialect; the
  parser must turn it into the same internal message as `reply_message(output)`, because that is
  what the bridge matches against (otherwise every turn forks as `assistant_edited`).
* **Errors are `GatewayError`.** The app answers each in the envelope of the dialect whose route
  it came from, `Dialect.error_body`: OpenAI's `{"error": {...}}` by default; a dialect with another
  envelope (Anthropic's `{"type": "error", ...}`) names its own function. Refusals before routing
  (a body over the size limit) and authentication failures take the same envelope.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from palaestra.gateway.errors import GatewayError
from palaestra.gateway.guards import json_or_text
from palaestra.gateway.parsers import ToolCall

__all__ = [
    "Dialect",
    "GenerationParams",
    "Reasoning",
    "StreamEvent",
    "StreamFailed",
    "StreamFinished",
    "StreamStarted",
    "TextDelta",
    "TextRequest",
    "TokenLogprob",
    "TurnOutput",
    "TurnRequest",
    "TurnResult",
    "reply_message",
]


# -- what a parser produces ----------------------------------------------------------------------
@dataclass(slots=True)
class GenerationParams:
    """Sampling and answer options, already validated and mapped to SGLang's names."""

    sampling: dict[str, Any]
    """SGLang `sampling_params` without `max_new_tokens` (the core sets it from `max_tokens`)."""
    n: int
    stream: bool
    include_usage: bool
    """Streaming: end the stream with a usage event (OpenAI's `stream_options.include_usage`)."""
    logprobs: bool
    """Report per-token logprobs in the answer."""
    top_logprobs: int
    """Alternatives per token, asked of the engine (0: none)."""
    stop: list[str]
    """Stop strings: a stream holds back text that may be the start of one."""
    max_tokens: int | None
    """None: the room left in the context, capped by the gateway's default."""
    max_tokens_field: str = "max_tokens"
    """The dialect's name of the field `max_tokens` came from (errors name it)."""


@dataclass(slots=True)
class Reasoning:
    """What a request asked of the model's reasoning, in the dialect's words (Anthropic `thinking` /
    `output_config.effort`, Responses `reasoning.effort`, chat `reasoning_effort`); the core maps
    it onto the chat template's switch, if it has one (`controls.resolve`)."""

    on: bool
    effort: str | None
    """The effort level asked for ("low", "medium", "high", "none", ...), or None."""
    field: str
    """The field it came from: recorded under this name when the template has no switch."""


@dataclass(slots=True)
class TurnRequest:
    """One chat call, dialect-neutral: what the core plans, generates and records from."""

    messages: list[dict[str, Any]]
    """Internal form: `renderer.normalize_messages`' output (the chat template's input)."""
    tools: list[dict[str, Any]] | None
    """Function tools in `renderer.normalize_tools`' form; None when the request has none."""
    tool_choice: str
    """'auto', 'none', 'required' or 'named' (then `named_tool`). Only 'none' changes what the
    gateway does (tool calls are not parsed); the others are validated and recorded."""
    params: GenerationParams
    named_tool: str | None = None
    template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables (e.g. `enable_thinking`)."""
    echo: dict[str, Any] = field(default_factory=dict)
    """Anything else the dialect's answer repeats from its request (e.g. a Responses API answer
    echoes `instructions` and `metadata`). The core never reads it."""
    previous: str | None = None
    """Continue a conversation the gateway kept (the Responses API's `previous_response_id`): its
    messages go between the first `preamble` messages and the rest."""
    preamble: int = 0
    """Leading messages that are not part of a kept conversation (Responses `instructions`)."""
    store: bool = False
    """Keep this call's conversation (messages after the preamble + the reply) under its call id."""
    reasoning: Reasoning | None = None
    """The request's reasoning ask, fitted to the template by the core (None: nothing asked)."""
    ignored: list[str] = field(default_factory=list)
    """Controls the request sent that nothing here acts on (`controls.py`): recorded on the turn,
    counted per session and in /metrics."""
    shaping: dict[str, Any] = field(default_factory=dict)
    """What the dialect's shaper needs from its request besides `echo` (Responses: the tool each
    rendered name stands for, whether reasoning is sealed; Anthropic: the thinking display). The
    core never reads it."""

    @property
    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True)
class TextRequest:
    """A raw text prompt (OpenAI's legacy completions): no chat template, no parsing of the output."""

    prompt: str
    params: GenerationParams
    echo: dict[str, Any] = field(default_factory=dict)


# -- what the core produces ----------------------------------------------------------------------
@dataclass(slots=True)
class TokenLogprob:
    """One sampled token's logprob, with the token's text; filled only when logprobs were asked for."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    """(text, logprob) of the most likely alternatives, best first."""


@dataclass(slots=True)
class TurnOutput:
    """One sampled choice, parsed: everything a shaper needs to answer it."""

    index: int
    text: str
    """The sampled text for the agent: decoded, the final stop token or stop string removed."""
    content: str | None
    """`text` without reasoning and parsed tool calls (None when empty and there are calls)."""
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish: str
    """'tool_calls' when calls were parsed, else the engine's finish type: 'stop', 'length',
    'abort'."""
    stop_matched: int | str | None
    """The stop token id or stop string that ended the choice (finish 'stop'), else None."""
    token_ids: list[int]
    """Every sampled id, the final stop token included (the trajectory keeps all of them)."""
    logprobs: list[TokenLogprob] | None
    """Per sampled token when the request asked for logprobs, else None."""
    weight_version: str
    cached_tokens: int


@dataclass(slots=True)
class TurnResult:
    """One call's answer, dialect-neutral."""

    call_id: str
    created: int
    model: str
    prompt_tokens: int
    outputs: list[TurnOutput]

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine found in its prefix cache (the first choice's count)."""
        return self.outputs[0].cached_tokens

    @property
    def weight_version(self) -> str:
        return self.outputs[0].weight_version


def reply_message(output: TurnOutput) -> dict[str, Any]:
    """The assistant message an agent sends back for `output`, in the internal form: exactly what
    `renderer.normalize_messages` makes of it (content a string, tool-call arguments parsed from
    JSON), built directly because it is digested on every call. tests/gateway/test_dialect.py pins
    the equality for the OpenAI message."""
    msg: dict[str, Any] = {"role": "assistant", "content": output.content or ""}
    if output.tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _json_or_text(c.arguments)},
            }
            for c in output.tool_calls
        ]
    if output.reasoning:
        msg["reasoning_content"] = output.reasoning
    return msg


def _json_or_text(arguments: str) -> Any:
    """Templates serialise arguments with `tojson`, so the internal form holds the parsed object;
    text that is not JSON stays text (as `normalize_messages` keeps it)."""
    return json_or_text(arguments)  # as `renderer.normalize_messages` does


# -- what a stream is made of ---------------------------------------------------------------------
@dataclass(slots=True)
class StreamStarted:
    """The call passed the pause gate and generation starts (first event)."""

    call_id: str
    created: int
    model: str
    prompt_tokens: int


@dataclass(slots=True)
class TextDelta:
    """Content that can go to the agent now (never a possible tool-call marker or stop string)."""

    text: str
    logprobs: list[TokenLogprob] | None


@dataclass(slots=True)
class StreamFinished:
    """The turn is recorded (last event). `unsent` is the content not yet sent as deltas;
    reasoning and tool calls of a streamed turn only arrive here, parsed whole."""

    result: TurnResult
    unsent: str


@dataclass(slots=True)
class StreamFailed:
    """The engine failed mid-call (last event); the failure is recorded on the session."""

    error: GatewayError


StreamEvent = StreamStarted | TextDelta | StreamFinished | StreamFailed

R = TypeVar("R", TurnRequest, TextRequest)


@dataclass(frozen=True)
class Dialect(Generic[R]):
    """A wire format: parser + shapers. `stream` None: the dialect's parser refuses `stream`."""

    call_id_prefix: str
    """Prefix of the call ids this dialect's answers carry (and turns record): 'chatcmpl-', ..."""
    parse: Callable[..., R]
    """body -> request; with `takes_memo`, (body, the session's `history.ParseMemo`) -> request."""
    answer: Callable[[R, TurnResult], dict[str, Any]]
    stream: Callable[[R, AsyncGenerator[StreamEvent, None]], AsyncGenerator[str, None]] | None = None
    """Written as an async generator: `streaming.ShapedStream` closes it with the response."""
    takes_memo: bool = False
    """The parser takes the session's `history.ParseMemo` as a second argument, so it converts only
    the messages a call adds to the history the previous call sent."""
    history_field: str = "messages"
    """The body field holding the conversation (Responses: 'input', completions: 'prompt'): errors the
    shared renderer raises about it (param 'messages') name this field instead (`routes._counted`)."""
    error_body: Callable[[GatewayError], dict[str, Any]] = GatewayError.body
    """A `GatewayError` -> the body this dialect's clients expect for it (default OpenAI's envelope,
    `GatewayError.body`). The app's error handlers and the body limit answer with it, for every
    route bound to the dialect (`routes.error_body`)."""
    name: str = ""
    """The route's name in metrics and session records ("chat", "responses", "messages", ...)."""
    headers: tuple[str, ...] = ()
    """Request headers the parser reads (lower-case), passed to it as `headers={name: value}`
    (Anthropic's `anthropic-beta` flags)."""
