"""What the model-calling environments (math-tool, code_sandbox, swe_agent, textarena) share: one
model turn (`model_turn`), the tool-calling loop built on it (`ToolLoop`), the record of one
episode — what went wrong, by name, and where the time went (`EpisodeLog`) — and the sampling
arguments of a session.

An environment that gives the model tools is its tools, its prompt and its reward:

    LOOP = ToolLoop(tools=[CALCULATOR_TOOL], max_turns=4, max_tokens=256)

    async def rollout(self, session, task):
        log = EpisodeLog()

        async def calculator(name: str, args: dict) -> str:   # args already checked against the schema
            return calculate(args["expression"])

        episode = await LOOP.run(session, [{"role": "user", "content": task.question}], calculator,
                                 model=self.model, log=log)
        result = await averify_math(episode.last_reply, task.answer)
        return Reward(result.reward, log.metrics(correct=float(result.correct)))

`ToolLoop.run` owns each turn: the model call (timed as ``time/model_s``, with the run's sampling
settings over the environment's `temperature`), the tool calls of the reply checked before a tool
runs (a known tool; arguments a JSON object holding every required argument with its declared
JSON-schema type — a tool that declares no properties gets ``{}`` whatever came), every
malformed call answered with the error as its tool result and counted as
``failure/tool_call_parse``, a reply that writes a call the gateway could not parse answered the
same way (as the user: it has no call id), a conversation that outgrew the context ending the
episode so that it is graded as it stands (``failure/context_exceeded``), and ``max_turns``. It
returns an `Episode`: the messages, why it ended, the final reply. A tool answers with text, or a
`ToolResult` that also names a failure to count or ends the episode (swe's ``submit``); a tool
that raises `ToolCallError` is a malformed call; anything else it raises leaves the loop.

Failure names (each becomes the metric ``failure/<name>``, a count, in the sample's metrics and in
``GET /sessions/{id}``):

- ``tool_call_parse``: the model wrote a tool call that could not be used (text that looks like a
  call but was not parsed, arguments that are not a JSON object, a missing argument, an unknown
  tool); the model got the error back as the tool result;
- ``sandbox_timeout``: a command the agent ran was killed at its time limit;
- ``sandbox_error``: the sandbox itself failed (could not start, died). Not the agent's doing, so
  the episode is not scored: the environment raises `sandbox_failed(exc)` (an `EpisodeFailed`),
  its session closes as failed with ``failure/sandbox_error`` and is never trained, and a training
  run counts it as ``rollout/failed_sandbox_error``. It is not retried: an episode is its
  session, and a new one in the same group would sample its turns again under other weights while
  the failed one's turns stay in the spool (dropped, reason ``failed``); GRPO normalises over the
  group's sessions that finished;
- ``grader_error``: grading could not decide (the grader did not run, a patch did not apply cleanly
  is *not* one: that scores 0 as the agent's fault);
- ``context_exceeded``: the conversation outgrew the model's context; the episode was graded as it
  stood;
- ``no_answer``: the episode ended without an answer to grade (max turns, or no code / no submit);
- ``harness_timeout``: a CLI harness (environments/harness) was stopped at the episode's turn or
  time budget; what it had done is graded;
- ``harness_exit``: a CLI harness exited non-zero or could not run; its last output is logged.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import openai

from palaestra.sdk.session import EpisodeFailed

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessage

    from palaestra.sandbox.base import ExecResult

__all__ = [
    "FAILURES",
    "Episode",
    "EpisodeLog",
    "ToolCallError",
    "ToolFn",
    "ToolLoop",
    "ToolResult",
    "check_arguments",
    "format_exec",
    "looks_like_a_tool_call",
    "model_turn",
    "resolve_backend",
    "sampling",
    "sandbox_failed",
]

FAILURES = (
    "tool_call_parse",
    "sandbox_timeout",
    "sandbox_error",
    "grader_error",
    "context_exceeded",
    "no_answer",
    "harness_timeout",
    "harness_exit",
)
PHASES = ("model", "sandbox", "grade")

# Text a model writes when it means to call a tool, in the chat formats the gateway parses. A reply
# with one of these and no parsed call is a malformed call, not an answer.
CALL_MARKERS = ("<tool_call>", "<|tool_call", "<function=", '{"name":', "<|python_tag|>")


def looks_like_a_tool_call(content: str | None) -> bool:
    return bool(content) and any(marker in content for marker in CALL_MARKERS)


@dataclass
class EpisodeLog:
    """Failures (named, counted) and seconds per phase of one episode."""

    failures: Counter = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: Counter = field(default_factory=Counter)

    def fail(self, name: str) -> None:
        if name not in FAILURES:
            raise ValueError(f"unknown failure {name!r}; one of {', '.join(FAILURES)}")
        self.failures[name] += 1

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    @contextlib.asynccontextmanager
    async def timed(self, phase: str) -> AsyncIterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self, **extra: float) -> dict[str, float]:
        out = {f"failure/{name}": float(self.failures[name]) for name in FAILURES}
        out |= {f"time/{phase}_s": round(s, 4) for phase, s in self.seconds.items()}
        out |= {name: float(n) for name, n in self.counts.items()}
        return out | {k: float(v) for k, v in extra.items()}


def sampling(session: Any, **defaults: Any) -> dict[str, Any]:
    """Keyword arguments for ``chat.completions.create``: the environment's defaults (temperature),
    overridden by what the run chose for this episode (``session.sampling``: seed, temperature)."""
    return {**defaults, **dict(session.sampling)}


async def model_turn(
    session: Any,
    messages: list[dict[str, Any]],
    *,
    model: str,
    max_tokens: int,
    log: EpisodeLog,
    temperature: float | None = None,
    tools: Sequence[dict[str, Any]] = (),
) -> ChatCompletionMessage | None:
    """One model call on the conversation `messages`: the reply appended to them and returned.
    Timed as ``time/model_s``; the run's sampling over the environment's `temperature`; None when
    the conversation outgrew the model's context (``failure/context_exceeded`` counted: the caller
    ends the episode there). Every other error of the call leaves it."""
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    defaults = {} if temperature is None else {"temperature": temperature}
    try:
        async with log.timed("model"):
            reply = await session.client.chat.completions.create(
                model=model,
                messages=messages,
                **extra,
                max_tokens=max_tokens,
                **sampling(session, **defaults),
            )
    except openai.BadRequestError as exc:
        if getattr(exc, "code", None) != "context_length_exceeded":
            raise
        log.fail("context_exceeded")
        return None
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    return message


# -- tools -----------------------------------------------------------------------------------------
class ToolCallError(ValueError):
    """The model's call could not be used; its message (starting "error:") goes back to the model
    as the tool result, and the call counts as ``failure/tool_call_parse``."""


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer when it says more than its text."""

    text: str
    """What the model reads as the tool's result."""
    failure: str | None = None
    """A failure to count (one of `FAILURES`, e.g. "sandbox_timeout"); the episode goes on."""
    ends_episode: bool = False
    """The episode ends once every call of this reply has run (swe's ``submit``)."""


ToolFn = Callable[[str, dict[str, Any]], Awaitable[str | ToolResult]]
"""``async (name, arguments) -> text | ToolResult``: runs one call of a tool the loop was given,
with arguments already checked against its schema (`check_arguments`)."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(tool: dict[str, Any], arguments: str | None) -> dict[str, Any]:
    """A call's arguments (the JSON text the model wrote) as a dict holding every argument the
    tool's schema requires, each of its declared type; else `ToolCallError` saying what is wrong.
    A tool that declares no properties takes no arguments: it gets ``{}`` whatever came."""
    schema = tool["function"].get("parameters") or {}
    properties = schema.get("properties") or {}
    if not properties:
        return {}
    try:
        args = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ToolCallError(f"error: the arguments are not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if not isinstance(args, dict):
        raise ToolCallError("error: the arguments must be a JSON object")
    for key in schema.get("required", ()):
        kind = (properties.get(key) or {}).get("type", "string")
        value = args.get(key)
        allowed = _JSON_TYPES.get(kind, (object,))
        if value is None or not isinstance(value, allowed) or (kind != "boolean" and isinstance(value, bool)):
            raise ToolCallError(f"error: missing {kind} argument {key!r}")
    return args


def _tool_names(tools: Sequence[dict[str, Any]]) -> str:
    names = sorted(t["function"]["name"] for t in tools)
    return f"the tool is {names[0]}" if len(names) == 1 else f"the tools are {', '.join(names)}"


def format_exec(result: ExecResult, limit: int = 2000) -> str:
    """A sandbox `ExecResult` as the model sees it: status line, then stdout and stderr (tails)."""
    head = f"exit code {result.exit_code}" if result.status == "ok" else f"{result.status}: {result.detail}"
    parts = [head]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            cut = text if len(text) <= limit else "...[truncated]...\n" + text[-limit:]
            parts.append(f"[{name}]\n{cut}")
    return "\n".join(parts)


# -- the loop --------------------------------------------------------------------------------------
@dataclass
class Episode:
    """What `ToolLoop.run` leaves: the conversation and why it ended."""

    messages: list[dict[str, Any]]
    """The whole conversation, the model's replies as the gateway answered them."""
    ended: Literal["answered", "tool", "max_turns", "context_exceeded"]
    """answered: a reply without tool calls was the answer; tool: a tool ended it
    (`ToolResult.ends_episode`); max_turns: the model was called `max_turns` times; context_exceeded:
    the next call would not fit the model's context."""

    @property
    def answer(self) -> str | None:
        """The final reply's text when the model answered (`ended` "answered"), else None."""
        return (self.messages[-1].get("content") or "") if self.ended == "answered" else None

    @property
    def last_reply(self) -> str:
        """The text of the model's last reply ("" for none): what grading "as it stands" reads."""
        return next((m.get("content") or "" for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def turns(self) -> int:
        """The model's replies."""
        return sum(m["role"] == "assistant" for m in self.messages)


@dataclass(frozen=True)
class ToolLoop:
    """The turns of a tool-using episode (module docstring); an environment builds one and calls
    `run` per episode."""

    tools: Sequence[dict[str, Any]]
    """OpenAI function tools; `run`'s `call_tool` serves every one of them."""
    max_turns: int
    """Model calls per episode, at most."""
    max_tokens: int
    """Tokens per model call, at most."""
    temperature: float | None = None
    """The environment's default temperature (None: the gateway's); the run's choice in
    ``session.sampling`` wins."""
    unparsed_call: str = "error: that tool call could not be parsed"
    """Sent as the user after a reply that looks like a tool call the gateway could not parse."""
    keep_going: str | None = None
    """None: a reply without tool calls is the answer and ends the episode. A text: such a reply is
    answered with it (as the user) and the episode goes on (swe: only ``submit`` ends it)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1; got {self.max_turns}")
        if not self.tools:
            raise ValueError("a ToolLoop needs at least one tool")

    async def run(
        self,
        session: Any,
        messages: list[dict[str, Any]],
        call_tool: ToolFn,
        *,
        model: str,
        log: EpisodeLog,
    ) -> Episode:
        """Runs the episode from `messages` (appended to in place) on `session`'s client."""
        by_name = {t["function"]["name"]: t for t in self.tools}
        log.count("tool_calls", 0)  # in the metrics even when the model called none
        for _ in range(self.max_turns):
            message = await model_turn(
                session,
                messages,
                model=model,
                max_tokens=self.max_tokens,
                log=log,
                temperature=self.temperature,
                tools=self.tools,
            )
            if message is None:
                return Episode(messages, "context_exceeded")
            if not message.tool_calls:
                if looks_like_a_tool_call(message.content):
                    log.fail("tool_call_parse")  # no call id to answer: say it as the user
                    messages.append({"role": "user", "content": self.unparsed_call})
                    continue
                if self.keep_going is None:
                    return Episode(messages, "answered")
                messages.append({"role": "user", "content": self.keep_going})
                continue
            ends = False
            for call in message.tool_calls:
                log.count("tool_calls")
                result = await self._call(by_name, call.function.name, call.function.arguments, call_tool)
                if result.failure is not None:
                    log.fail(result.failure)
                ends = ends or result.ends_episode
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
            if ends:
                return Episode(messages, "tool")
        return Episode(messages, "max_turns")

    async def _call(
        self, by_name: dict[str, dict[str, Any]], name: str, arguments: str | None, call_tool: ToolFn
    ) -> ToolResult:
        try:
            tool = by_name.get(name)
            if tool is None:
                raise ToolCallError(f"error: unknown tool {name!r}; {_tool_names(self.tools)}")
            result = await call_tool(name, check_arguments(tool, arguments))
        except ToolCallError as exc:
            return ToolResult(str(exc), failure="tool_call_parse")
        return result if isinstance(result, ToolResult) else ToolResult(result)


def sandbox_failed(exc: BaseException) -> EpisodeFailed:
    """The failure to raise (``raise sandbox_failed(exc) from exc``) when the episode's sandbox
    failed under it (`SandboxError`: could not start, its exec server or container died): the
    episode fails, ``failure/sandbox_error``, and is never trained (module docstring)."""
    return EpisodeFailed("sandbox_error", str(exc))


def resolve_backend(backend: Any) -> Any:
    """A sandbox backend from a spec string (``palaestra.sandbox.get_backend``: "local", "docker",
    "http://host:port"), an import path ``package.module:Class`` (called with no arguments), or a
    ready `Backend`."""
    if not isinstance(backend, str):
        return backend
    from palaestra.plugins import is_import_path, load_object

    if is_import_path(backend):
        return load_object(backend, "sandbox backend", callable_=True)()
    from palaestra.sandbox import get_backend

    return get_backend(backend)
