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

When that is not possible or not faithful, the call forks: its prompt is the template's full
rendering of M, and the fork's reason is recorded (see `trajectory.FORK_REASONS`):

* no earlier request is a prefix of M -> `prefix_changed`;
* a prefix matches but the assistant message differs from the reply -> `assistant_edited`;
* the previous turn ended by max_tokens -> `truncated`;
* the template renders the shared history differently once extended -> `template_nonmonotonic`,
  or `reasoning_stripped` when what disappears is reasoning the model produced (Qwen3, GLM drop
  `<think>` of earlier turns). With `reasoning_policy="keep"` such turns are bridged anyway: the
  policy keeps seeing its own reasoning, which is what it was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from palaestra.gateway.renderer import ChatRenderer, message_digest
from palaestra.gateway.trajectory import Turn

SENTINEL = "\u2063PALAESTRA\u2063SENTINEL\u2063"


@dataclass
class Plan:
    prompt_ids: list[int]
    rendered: str  # the template's rendering of the full request (kept for the next turn's checks)
    parent: Turn | None
    fork_reason: str | None = None
    fork_detail: str = ""
    bridge_tokens: int = 0


def _fork(renderer: ChatRenderer, rendered: str, reason: str | None, detail: str = "") -> Plan:
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
) -> Plan:
    """Decides how the prompt for `messages` is built (bridged from a parent turn, or a fork)."""
    rendered = renderer.render(messages, tools, True, template_extra)
    if not has_turns:
        return _fork(renderer, rendered, None)
    # the longest earlier request M_c = messages[:k] followed here by an assistant message
    prefix_k, candidates = 0, []
    for k in range(len(messages) - 1, 0, -1):
        found = turns_by_digest.get(digests[k - 1])
        if found and messages[k]["role"] == "assistant":
            prefix_k, candidates = k, found
            break
    if not candidates:
        return _fork(renderer, rendered, "prefix_changed", "no earlier request is a prefix of this one")
    echoed = message_digest(messages[prefix_k], loose_assistant=True)
    matching = [t for t in candidates if t.reply_digest == echoed]
    if not matching:
        return _fork(
            renderer, rendered, "assistant_edited", f"message {prefix_k} differs from what the model replied"
        )
    parent = max(matching, key=lambda t: (t.children == 0, t.turn_id))  # prefer the live tip
    if parent.finish_reason.get("type") == "length":
        return _fork(renderer, rendered, "truncated", f"turn {parent.turn_id} ended at max_tokens")
    sentinel = {"role": "assistant", "content": SENTINEL}
    if messages[prefix_k].get("reasoning_content"):  # templates render reasoning before the content
        sentinel["reasoning_content"] = messages[prefix_k]["reasoning_content"]
    sentinel_msgs = [*messages[:prefix_k], sentinel, *messages[prefix_k + 1 :]]
    with_sentinel = renderer.render(sentinel_msgs, tools, True, template_extra)
    pos = with_sentinel.find(SENTINEL)
    if pos < 0:
        return _fork(
            renderer, rendered, "template_nonmonotonic", "the template does not render assistant content"
        )
    history_ok = (
        rendered.startswith(parent.rendered)
        and with_sentinel.startswith(parent.rendered)
        and pos >= len(parent.rendered)
    )
    if not history_ok:
        reason = "reasoning_stripped" if _lost_reasoning(parent, rendered) else "template_nonmonotonic"
        if not (reason == "reasoning_stripped" and reasoning_policy == "keep"):
            return _fork(renderer, rendered, reason, "the template renders the earlier turns differently now")
    before_content = with_sentinel[len(parent.rendered) : pos] if history_ok else ""
    tail = with_sentinel[pos + len(SENTINEL) :]
    if not rendered.endswith(tail):
        return _fork(
            renderer,
            rendered,
            "template_nonmonotonic",
            "the new messages render differently after this assistant turn",
        )
    if before_content and not parent.output_text.startswith(before_content):
        if parent.had_reasoning and reasoning_policy != "keep":
            return _fork(
                renderer,
                rendered,
                "reasoning_stripped",
                f"the template renders this turn as {before_content!r}... without the model's reasoning",
            )
        if not parent.had_reasoning:
            return _fork(
                renderer,
                rendered,
                "template_nonmonotonic",
                f"the template opens past assistant turns with {before_content!r}",
            )
    if parent.had_reasoning and reasoning_policy != "keep" and not _reasoning_kept(rendered, parent):
        return _fork(renderer, rendered, "reasoning_stripped", "the template drops this turn's reasoning")
    last = parent.output_ids[-1] if parent.output_ids else None
    closing = stop_text.get(last, "") if parent.finish_reason.get("type") == "stop" else ""
    if closing and tail.startswith(closing):
        tail = tail[len(closing) :]
    bridge = renderer.encode(tail)
    return Plan(parent.prompt_ids + parent.output_ids + bridge, rendered, parent, bridge_tokens=len(bridge))


def _lost_reasoning(parent: Turn, rendered: str) -> bool:
    """Whether what the template now renders differently is reasoning (or an empty think block).

    Qwen3 without thinking opens every generation with an empty `<think></think>` that later turns
    drop; GLM drops `<think>...</think>` of turns before the last user message.
    """
    if any(t.had_reasoning for t in parent.path()):
        return True
    before = parent.rendered
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
