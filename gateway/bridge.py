"""Turn bridging: the next prompt is built from the exact tokens of the previous turn.

For a chat call with messages M, find the earlier turn c of the session whose request messages
M_c are a prefix of M and whose reply is the assistant message that follows them in M:
M = M_c + [reply_c] + new. Then

    prompt = prompt_c + output_c + tokens(tail)

where `tail` is the template's text for the new messages after the assistant turn: the text that
follows the assistant content when M is rendered with a sentinel in place of that content (the
closing of the assistant turn, the new messages, the generation prompt). If the model already
sampled the closing token (an EOS such as `<|im_end|>`), it is not added twice. Only `tail` is
tokenized, so the tokenizer's work does not grow with the history; the model's own tokens are
never re-tokenized.

A turn cut at max_tokens is bridged the same way when the agent sends its text back: its sampled ids
stay as sampled (trained), and the closing the template puts after them (`<|im_end|>` for ChatML)
enters with the tail, as context (loss-masked like every bridge token). Forking there instead would
start a new sample holding the whole history again on every such turn: a session of cut answers
would store and train on quadratically many tokens.

When that is not possible or not faithful, the call forks: its prompt is the template's full
rendering of M, and the fork's reason is recorded (see `trajectory.FORK_REASONS`):

* no earlier request is a prefix of M -> `prefix_changed`;
* a prefix matches but the assistant message differs from the reply -> `assistant_edited`;
* the template renders the shared history differently once extended -> `template_nonmonotonic`,
  or `reasoning_stripped` when what disappears is reasoning the model produced (Qwen3, GLM drop
  `<think>` of earlier turns). With `reasoning_policy="keep"` such turns are bridged anyway: the
  policy keeps seeing its own reasoning, which is what it was trained on.

Those checks read whole renderings. A turn that appends only tool results to a history with
reasoning builds them from the parent's whole rendering and a short one (`_bridge_appended`, for
templates that pass `append_ok`), so its cost does not grow with the history; any other turn that
is not bridged from a short rendering (`_bridge_short`) renders the whole history.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from palaestra.gateway.engine_side.generation import FinishKind
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import ChatRenderer, message_digest
from palaestra.gateway.sessions.trajectory import Turn

SENTINEL = "\u2063PALAESTRA\u2063SENTINEL\u2063"


@dataclass
class Plan:
    prompt_ids: Sequence[int]  # a `PromptIds` where bridged (not copied)
    rendered: str  # the template's rendering of the full request (kept for the next turn's checks)
    parent: Turn | None
    fork_reason: str | None = None
    fork_detail: str = ""
    bridge_tokens: int = 0


_SAME_REQUEST_SCAN = 8
"""Most earlier turns with the same messages a fork looks through for one it can take the ids of."""


def _fork(
    renderer: ChatRenderer,
    rendered: str,
    reason: str | None,
    detail: str = "",
    same_messages: list[Turn] | None = None,
) -> Plan:
    """A new sample whose prompt is the tokens of `rendered`: those of an earlier root turn that
    rendered to the same text (`same_messages`: the turns whose request had these messages), else
    tokenized. A retry, another sample of the same turn (n > 1 sampling across calls, a GRPO-style
    group on one session) or a benchmark's repeated call then skips the tokenizer, the largest part
    of planning a short fork. A root's prompt is `encode(rendered)` of its `rendered` and tokenizing
    is a function of the text, so the ids are the same; the list is a copy, as `encode`'s would be."""
    for turn in itertools.islice(reversed(same_messages or ()), _SAME_REQUEST_SCAN):  # the latest first
        if turn.parent is None and turn.rendered == rendered:
            return Plan(turn.tokens[: turn.prompt_len], rendered, None, reason, detail)
    return Plan(renderer.encode(rendered), rendered, None, reason, detail)


def plan_chat(
    renderer: ChatRenderer,
    turns_by_digest: dict[int, list[Turn]],
    has_turns: bool,
    messages: list[dict[str, Any]],
    digests: list[int],
    tools: list[dict[str, Any]] | None,
    stop_text: dict[int, str],
    reasoning_policy: str = "strip",
    template_extra: dict[str, Any] | None = None,
    context_key: int | None = None,
    short: ShortRender | None = None,
    appends: AppendRenders | None = None,
) -> Plan:
    """Decides how the prompt for `messages` is built (bridged from a parent turn, or a fork).

    `context_key` identifies what besides the messages the template reads (tools, template
    arguments); `short` (not None: the template passed `incremental_ok` with these template
    arguments: `RenderGaps`) lets an append to a turn without reasoning be rendered from its last
    messages only (`_bridge_short`); `appends` (the template's `AppendRenders`) lets an append of
    tool results to a turn with reasoning be checked from the parent's rendering and a short one
    (`_bridge_appended`)."""
    if not has_turns:
        return _fork_rendering(renderer, messages, tools, template_extra, _Fork("", ""), None)
    try:
        prefix_k, parent = _parent(turns_by_digest, messages, digests)
        same_context = parent.context_key == context_key
        append = _Append(renderer, messages, prefix_k, parent, tools, stop_text, template_extra)
        # the gap was measured with these template arguments, the parent's were the same
        if short is not None and same_context and not parent.reasoning_on_path:
            plan = _bridge_short(append, short)
            if plan is not None:
                return plan
        if appends is not None and same_context:  # the parent's rendering had these tools and arguments
            plan = _bridge_appended(append, appends, reasoning_policy)
            if plan is not None:
                return plan
        return _bridge_full(append, reasoning_policy, same_context)
    except _Fork as no:
        same = turns_by_digest.get(digests[-1]) if digests else None
        if no.rendered:
            return _fork(renderer, no.rendered, no.reason, no.detail, same)
        return _fork_rendering(renderer, messages, tools, template_extra, no, same)


def _fork_rendering(
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_extra: dict[str, Any] | None,
    no: _Fork,
    same_messages: list[Turn] | None,
) -> Plan:
    """A fork (`no`'s reason; empty: the session's first call) rendered whole: the rendering and ids
    the renderer kept for an equal request (`ChatRenderer.recall`), else rendered and then `_fork`."""
    key = renderer.memo_key(messages, tools, template_extra)
    known = renderer.recall(key)
    if known is not None:
        return Plan(known[1], known[0], None, no.reason or None, no.detail)
    plan = _fork(
        renderer,
        renderer.render(messages, tools, True, template_extra),
        no.reason or None,
        no.detail,
        same_messages,
    )
    renderer.remember(key, plan.rendered, plan.prompt_ids)
    return plan


class _Fork(Exception):
    """The request cannot be bridged onto an earlier turn: a new sample, for `reason`."""

    def __init__(self, reason: str, detail: str, rendered: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail, self.rendered = reason, detail, rendered  # rendered: when already done


def _parent(
    turns_by_digest: dict[int, list[Turn]], messages: list[dict[str, Any]], digests: list[int]
) -> tuple[int, Turn]:
    """The turn this request continues, and where its reply sits in `messages`: the longest earlier
    request messages[:k] followed here by an assistant message that is that turn's reply as sent."""
    prefix_k, candidates = 0, []
    for k in range(len(messages) - 1, 0, -1):
        found = turns_by_digest.get(digests[k - 1])
        if found and messages[k]["role"] == "assistant":
            prefix_k, candidates = k, found
            break
    if not candidates:
        raise _Fork("prefix_changed", "no earlier request is a prefix of this one")
    echoed = message_digest(messages[prefix_k], loose_assistant=True)
    matching = [t for t in candidates if t.reply_digest == echoed]
    if not matching:
        raise _Fork("assistant_edited", f"message {prefix_k} differs from what the model replied")
    parent = max(matching, key=lambda t: (t.children == 0, t.turn_id))  # prefer the live tip
    return prefix_k, parent


@dataclass(frozen=True)
class _Append:
    """A request that appends to `parent`'s reply (message `prefix_k`), with what rendering needs."""

    renderer: ChatRenderer
    messages: list[dict[str, Any]]
    prefix_k: int
    parent: Turn
    tools: list[dict[str, Any]] | None
    stop_text: dict[int, str]
    template_extra: dict[str, Any] | None

    def parts(self) -> tuple[Any, ...]:
        """The fields in order, uncopied (dataclasses.astuple would deep-copy the history)."""
        return (
            self.renderer,
            self.messages,
            self.prefix_k,
            self.parent,
            self.tools,
            self.stop_text,
            self.template_extra,
        )


def _bridge_full(append: _Append, reasoning_policy: str, same_context: bool) -> Plan:
    """The bridge checked on whole renders: the history renders as it did for `parent`, the reply's
    place is found with a sentinel, and the template keeps (or, policy `keep`, may drop) reasoning."""
    renderer, messages, prefix_k, parent, tools, stop_text, template_extra = append.parts()
    parent_rendered = parent.rendered
    if not parent_rendered:  # the parent was planned incrementally: render its request in full now
        if not same_context:
            raise _Fork("template_nonmonotonic", "the tools or template arguments changed")
        parent_rendered = renderer.render(messages[:prefix_k], tools, True, template_extra)
    rendered = renderer.render(messages, tools, True, template_extra)
    with_sentinel = renderer.render(_sentinel_messages(messages, prefix_k), tools, True, template_extra)
    return _bridge_rendered(append, parent_rendered, rendered, with_sentinel, reasoning_policy)


def _sentinel_messages(messages: list[dict[str, Any]], prefix_k: int) -> list[dict[str, Any]]:
    """`messages` with the sentinel in place of the reply `messages[prefix_k]` (its reasoning kept:
    templates render reasoning before the content)."""
    return [*messages[:prefix_k], _sentinel(messages[prefix_k]), *messages[prefix_k + 1 :]]


def _sentinel(reply: dict[str, Any]) -> dict[str, Any]:
    """The sentinel assistant message standing for `reply` (its reasoning kept)."""
    sentinel = {"role": "assistant", "content": SENTINEL}
    if reply.get("reasoning_content"):
        sentinel["reasoning_content"] = reply["reasoning_content"]
    return sentinel


def _bridge_rendered(
    append: _Append, parent_rendered: str, rendered: str, with_sentinel: str, reasoning_policy: str
) -> Plan:
    """The full path's checks on the whole renderings of the parent's request, this request and
    this request with the sentinel in the reply (`_bridge_full`; `_bridge_appended` builds the two
    latter from the parent's and a short rendering)."""
    renderer, _, _, parent, _, stop_text, _ = append.parts()
    pos = with_sentinel.find(SENTINEL)
    if pos < 0:
        raise _Fork("template_nonmonotonic", "the template does not render assistant content", rendered)
    history_ok = (
        rendered.startswith(parent_rendered)
        and with_sentinel.startswith(parent_rendered)
        and pos >= len(parent_rendered)
    )
    if not history_ok:
        reason = (
            "reasoning_stripped"
            if _lost_reasoning(parent, parent_rendered, rendered)
            else "template_nonmonotonic"
        )
        if not (reason == "reasoning_stripped" and reasoning_policy == "keep"):
            raise _Fork(reason, "the template renders the earlier turns differently now", rendered)
    before_content = with_sentinel[len(parent_rendered) : pos] if history_ok else ""
    tail = with_sentinel[pos + len(SENTINEL) :]
    if not rendered.endswith(tail):
        raise _Fork(
            "template_nonmonotonic", "the new messages render differently after this assistant turn", rendered
        )
    _check_reasoning(parent, before_content, rendered, reasoning_policy)
    return _bridged(renderer, parent, tail, rendered, stop_text)


def _bridge_appended(append: _Append, appends: AppendRenders, reasoning_policy: str) -> Plan | None:
    """The full path's bridge where the request appends tool results only: the two whole renderings
    built as the parent's rendering (its `rendered`, the template's whole text of its request) plus
    what a short conversation renders after its own history (`_short_tail`), then the full path's
    checks on them. Such an append moves none of what a template decides the history's rendering by
    (no new user message: Qwen3's `last_query_index` and GLM's `last_user_index` stay), and
    `append_ok` has checked this template on probe conversations. None (the full path decides) when
    the parent has no whole rendering, the append holds anything but tool messages, the short
    conversation renders no extension of its history or fails, or the checks would fork."""
    renderer, messages, prefix_k, parent, tools, _, extra = append.parts()
    whole = parent.rendered
    new = messages[prefix_k + 1 :]
    if not whole or not new or any(m["role"] != "tool" for m in new):
        return None
    allowed = appends.get(extra)
    if allowed is None:
        return None
    tails = _short_tail(renderer, messages, prefix_k, None if allowed.tools_free else tools, extra)
    if tails is None:
        return None
    try:
        return _bridge_rendered(append, whole, whole + tails[0], whole + tails[1], reasoning_policy)
    except _Fork:  # decided (and recorded) by the full path, on its whole renderings
        return None


_KEPT_ROLES = ("system", "user")


def _short_tail(
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    prefix_k: int,
    tools: list[dict[str, Any]] | None,
    extra: dict[str, Any] | None,
) -> tuple[str, str] | None:
    """What the template renders after the history `messages[:prefix_k]` for the reply and the new
    messages, and for the sentinel in the reply's place, from a short conversation: the history's
    system and user messages (what a template's choice of which reasoning to keep reads), the
    message before the reply, the reply (or the sentinel) and the new messages. None when the short
    conversation's history is not a prefix of either rendering, or the template refuses it."""
    context = [m for m in messages[: prefix_k - 1] if m["role"] in _KEPT_ROLES]
    context.append(messages[prefix_k - 1])
    new = messages[prefix_k + 1 :]
    try:
        head = renderer.render(context, tools, True, extra)
        shown = renderer.render([*context, messages[prefix_k], *new], tools, True, extra)
        if not shown.startswith(head):
            return None
        with_sentinel = renderer.render([*context, _sentinel(messages[prefix_k]), *new], tools, True, extra)
    except GatewayError:
        return None
    if not with_sentinel.startswith(head):
        return None
    return shown[len(head) :], with_sentinel[len(head) :]


def _check_reasoning(parent: Turn, before_content: str, rendered: str, reasoning_policy: str) -> None:
    """Forks when the template renders the parent's turn other than the model wrote it: its
    reasoning dropped (unless policy `keep`), or text opened before the content that it did not write."""
    if before_content and not parent.output_text.startswith(before_content):
        if parent.had_reasoning and reasoning_policy != "keep":
            raise _Fork(
                "reasoning_stripped",
                f"the template renders this turn as {before_content!r}... without the model's reasoning",
                rendered,
            )
        if not parent.had_reasoning:
            raise _Fork(
                "template_nonmonotonic",
                f"the template opens past assistant turns with {before_content!r}",
                rendered,
            )
    if parent.had_reasoning and reasoning_policy != "keep" and not _reasoning_kept(rendered, parent):
        raise _Fork("reasoning_stripped", "the template drops this turn's reasoning", rendered)


def _bridged(
    renderer: ChatRenderer, parent: Turn, tail: str, rendered: str, stop_text: dict[int, str]
) -> Plan:
    """prompt = the parent's prompt + output + the tokens of `tail` (its closing token not twice).

    A turn cut at max_tokens (kind LENGTH) usually lacks the closing, which then comes from `tail`;
    an engine may call a turn that sampled the closing as its last allowed token LENGTH (whichever
    check it runs first), and that closing is not added twice either."""
    last = parent.output_ids[-1] if parent.output_ids else None
    ended = parent.finish_reason.kind in (FinishKind.STOP, FinishKind.LENGTH)
    closing = stop_text.get(last, "") if ended else ""
    if closing and tail.startswith(closing):
        tail = tail[len(closing) :]
    bridge = renderer.encode(tail)
    # the engine call needs the whole list; the turn recorded from it appends only `bridge` and its
    # output to the parent's (`Turn.tokens`), and the request's JSON is the parent's plus the bridge's
    # (`PromptIds`: neither compares the history again)
    return Plan(parent.extended(bridge), rendered, parent, bridge_tokens=len(bridge))


def _bridge_short(append: _Append, short: ShortRender) -> Plan | None:
    """The bridge from a short rendering: the leading system message, the message before the
    assistant turn, the turn and the new messages, so the cost does not grow with the history.
    The full path's checks on the short conversation, with the template's gap (what it puts
    between the generation prompt and an assistant's content, measured once by `incremental_ok`)
    instead of a third rendering; None (use the full path) when any fails. Rendered without the
    tool schemas where the template puts them only ahead of the conversation (`tools_up_front`: the
    text from the message before the assistant turn on is the same). `Plan.rendered` stays empty: a
    later full-path check renders this request then."""
    renderer, messages, prefix_k, parent, tools, stop_text, extra = append.parts()
    gap = short.gap
    if short.tools_up_front:
        tools = None
    lead = 1 if messages[0]["role"] == "system" else 0
    context = [*messages[:lead], *messages[max(lead, prefix_k - 1) : prefix_k]]
    new = messages[prefix_k + 1 :]
    try:  # a template may refuse the short conversation (e.g. one that must open with a user turn)
        sentinel = {"role": "assistant", "content": SENTINEL}
        with_sentinel = renderer.render([*context, sentinel, *new], tools, True, extra)
        shown = renderer.render([*context, messages[prefix_k], *new], tools, True, extra)
    except GatewayError:
        return None
    pos = with_sentinel.find(SENTINEL)
    if pos < 0 or not with_sentinel.endswith(gap, 0, pos) or not parent.output_text.startswith(gap):
        return None
    if not shown.startswith(with_sentinel[:pos]):
        return None
    tail = with_sentinel[pos + len(SENTINEL) :]
    if not shown.endswith(tail):
        return None
    return _bridged(renderer, parent, tail, "", stop_text)


def incremental_ok(renderer: ChatRenderer, extra: dict[str, Any] | None = None) -> str | None:
    """Whether this template renders an appended turn the same from a short context as from the
    whole history, and renders a history the same once it is extended (checked once, on probe
    conversations with and without tool calls; the full path checks the latter on every call).
    Returns the template's gap between the generation prompt and an assistant's content (the
    same in every probe: '' for ChatML), or None when the template is not fit for it. `extra`: the
    template arguments to render with (`enable_thinking=False` makes Qwen3's unfit)."""
    gaps = set()
    tool = {
        "type": "function",
        "function": {"name": "probe", "description": "p", "parameters": {"type": "object"}},
    }
    call = {"id": "c1", "type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    convos = [
        (None, ["user", "assistant", "user", "assistant", "user"]),
        ([tool], ["user", "assistant+call", "tool", "assistant", "user"]),
    ]
    for tools, roles in convos:
        for lead in ([{"role": "system", "content": "S."}], []):
            messages = [*lead]
            for i, role in enumerate(roles):
                if role == "assistant+call":
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                elif role == "tool":
                    messages.append({"role": "tool", "tool_call_id": "c1", "content": f"r{i}"})
                else:
                    messages.append({"role": role, "content": f"m{i}"})
            k = len(messages) - 2  # the last assistant message
            try:
                full = renderer.render(
                    [*messages[:k], {"role": "assistant", "content": SENTINEL}, messages[-1]],
                    tools,
                    True,
                    extra,
                )
                n = len(lead)
                short = [
                    *messages[:n],
                    messages[k - 1],
                    {"role": "assistant", "content": SENTINEL},
                    messages[-1],
                ]
                part = renderer.render(short, tools, True, extra)
                head = renderer.render(messages[:k], tools, True, extra)  # renders as before, extended
            except Exception:
                return None
            if not full.startswith(head) or SENTINEL not in full[len(head) :]:
                return None
            if full.split(SENTINEL)[1] != part.split(SENTINEL)[-1]:
                return None
            gaps.add(full[len(head) : full.find(SENTINEL)])
    return gaps.pop() if len(gaps) == 1 else None


def tools_up_front(renderer: ChatRenderer, extra: dict[str, Any] | None = None) -> bool:
    """Whether this template renders the tool schemas only ahead of the conversation (in its system
    block), so that a short conversation renders the same with or without them from the message
    before the assistant turn on: the gap, the assistant turn (as a sentinel or with tool calls) and
    what follows it. Then the short bridge renders without them: a harness sends ~30 KB of schemas
    with every call, which the template serialises again on every rendering. Checked once on probe
    conversations (a user message or a tool result before the turn and after it, with and without a
    system message); False when any differs or fails to render."""
    tool = {
        "type": "function",
        "function": {"name": "probe", "description": "p", "parameters": {"type": "object"}},
    }
    call = {"id": "c1", "type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    turns = (
        {"role": "assistant", "content": SENTINEL},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    )

    def message(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": text, **({"tool_call_id": "c1"} if role == "tool" else {})}

    for lead in ([{"role": "system", "content": "S."}], []):
        for before, after in itertools.product(("user", "tool"), repeat=2):
            for turn in turns:
                convo = [*lead, message(before, "before-probe"), turn, message(after, "after-probe")]
                try:
                    with_tools = renderer.render(convo, [tool], True, extra)
                    without = renderer.render(convo, None, True, extra)
                except Exception:
                    return False
                start = without.find("before-probe")
                if start < 0 or not with_tools.endswith(without[start:]):
                    return False
    return True


@dataclass(frozen=True)
class ShortRender:
    """What the start-up probes allow a template's short rendering (`_bridge_short`)."""

    gap: str  # between the generation prompt and an assistant's content (`incremental_ok`)
    tools_up_front: bool  # render it without the tool schemas (`tools_up_front`)


_Probed = TypeVar("_Probed")


class _PerArgs(Generic[_Probed]):
    """A template probe's answer per set of template arguments, each probed once: a call's
    `chat_template_kwargs`, or the thinking switch its reasoning ask maps to, change what the
    template renders, so Claude Code's and Codex's calls (which ask for thinking) need their own
    probe. The arguments come from clients: past `limit` different sets, a new one renders in full."""

    def __init__(self, renderer: ChatRenderer, limit: int = 32) -> None:
        self.renderer, self.limit = renderer, limit
        self._found: dict[bytes, _Probed | None] = {}

    def _probe(self, extra: dict[str, Any] | None) -> _Probed | None:
        raise NotImplementedError

    def get(self, extra: dict[str, Any] | None) -> _Probed | None:
        """What the probe allows with template arguments `extra` (None: render in full)."""
        try:
            key = orjson.dumps(extra or {}, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            return None
        if key not in self._found:
            if len(self._found) >= self.limit:
                return None
            self._found[key] = self._probe(extra)
        return self._found[key]


class RenderGaps(_PerArgs[ShortRender]):
    """`incremental_ok` and `tools_up_front` per set of template arguments (`_PerArgs`), the
    template's own (no arguments) probed at start-up; what the short rendering may use."""

    def __init__(self, renderer: ChatRenderer, limit: int = 32) -> None:
        super().__init__(renderer, limit)
        self._found[b"{}"] = self._probe(None)

    def _probe(self, extra: dict[str, Any] | None) -> ShortRender | None:
        gap = incremental_ok(self.renderer, extra)
        return None if gap is None else ShortRender(gap, tools_up_front(self.renderer, extra))


@dataclass(frozen=True)
class AppendRender:
    """What `append_ok` allows a template's appended tool results (`_bridge_appended`)."""

    tools_free: bool  # the short conversation rendered without the tool schemas gives the same text


def _append_probes() -> list[tuple[list[dict[str, Any]], int]]:
    """Probe requests for `append_ok`: (messages, index of the reply) of histories with reasoning
    (as a field and in the content), tool calls, earlier user turns, a system message in the middle
    and a user message that is a tool response (Qwen3 does not count it as a query), each followed
    by a reply of each kind with one or two tool results, with and without a leading system message."""
    call = {"id": "c1", "type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}

    def assistant(kind: str, i: int) -> dict[str, Any]:
        if kind == "field":  # reasoning as a field, then a tool call
            return {"role": "assistant", "content": "", "reasoning_content": f"why{i}", "tool_calls": [call]}
        if kind == "think":  # reasoning written in the content
            return {
                "role": "assistant",
                "content": f"<think>\nwhy{i}\n</think>\n\nso{i}",
                "tool_calls": [call],
            }
        if kind == "call":
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return {"role": "assistant", "content": f"said{i}", "reasoning_content": f"why{i}"}  # "text"

    def tool(i: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": "c1", "content": f"out{i}"}

    def user(i: int) -> dict[str, Any]:
        return {"role": "user", "content": f"ask{i}"}

    wrapped = {"role": "user", "content": "<tool_response>\nw\n</tool_response>"}
    histories = [
        [user(0)],
        [user(0), assistant("text", 1), user(2), assistant("field", 3), tool(3), assistant("call", 4), tool(4)],
        [user(0), assistant("think", 1), tool(1), {"role": "system", "content": "mid"}, wrapped,
         assistant("field", 5), tool(5), tool(6)],
        [wrapped, assistant("field", 1), tool(1)],
    ]  # fmt: skip
    out = []
    for lead in ([{"role": "system", "content": "S."}], []):
        for history in histories:
            for kind, new in (("field", 1), ("think", 2), ("call", 1), ("text", 2)):
                head = [*lead, *history]
                out.append(([*head, assistant(kind, 7), *(tool(8 + j) for j in range(new))], len(head)))
    return out


def append_ok(renderer: ChatRenderer, extra: dict[str, Any] | None = None) -> AppendRender | None:
    """Whether the template renders a request that appends tool results to a reply as the parent's
    whole rendering plus what the short conversation renders after its history (`_short_tail`),
    checked once on 64 probe requests (`_append_probes`) with and without a tool: on every probe whose
    short conversation passes, both texts (the request, the request with the sentinel) must be the
    whole renderings, and the whole renderings must not fail. None when any is not; `tools_free`:
    the same holds with the short conversation rendered without the tool schemas."""
    tool = {
        "type": "function",
        "function": {"name": "probe", "description": "p", "parameters": {"type": "object"}},
    }
    tools_free = True
    for tools in (None, [tool]):
        for messages, k in _append_probes():
            try:
                head = renderer.render(messages[:k], tools, True, extra)
                whole = renderer.render(messages, tools, True, extra)
                whole_sentinel = renderer.render(_sentinel_messages(messages, k), tools, True, extra)
            except Exception:
                return None
            for short_tools in (tools, None) if tools else (tools,):
                tails = _short_tail(renderer, messages, k, short_tools, extra)
                if tails is None:
                    continue
                if head + tails[0] != whole or head + tails[1] != whole_sentinel:
                    if short_tools is tools:
                        return None
                    tools_free = False
    return AppendRender(tools_free)


class AppendRenders(_PerArgs[AppendRender]):
    """`append_ok` per set of template arguments (`_PerArgs`), each probed on the first request
    that needs it; what `_bridge_appended` may use."""

    def _probe(self, extra: dict[str, Any] | None) -> AppendRender | None:
        return append_ok(self.renderer, extra)


def _lost_reasoning(parent: Turn, before: str, rendered: str) -> bool:
    """Whether what the template now renders differently is reasoning (or an empty think block).

    Qwen3 without thinking opens every generation with an empty `<think></think>` that later turns
    drop; GLM drops `<think>...</think>` of turns before the last user message.
    """
    if parent.reasoning_on_path:
        return True
    same = 0
    for a, b in zip(before, rendered, strict=False):  # the fork path only: first difference
        if a != b:
            break
        same += 1
    return "think>" in before[same:]


def _reasoning_kept(rendered: str, turn: Turn) -> bool:
    """Whether the template kept the reasoning text of `turn` (a cheap check on its longest line)."""
    text = turn.output_text
    start, end = text.find("<think>"), text.find("</think>")
    body = text[start + len("<think>") if start >= 0 else 0 : end if end >= 0 else len(text)].strip()
    probe = max(body.splitlines() or [""], key=len).strip()
    return not probe or probe in rendered
