"""A turn that appends tool results to a history holding reasoning is bridged from the parent's whole
rendering plus a short rendering (`bridge._bridge_appended`), where the full path renders the whole
history twice: random sessions planned both ways, for every preset's chat template and for two
templates that the probe (`bridge.append_ok`) must refuse, give the same prompt ids, renderings,
parents, forks and recorded token lists, turn by turn."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from palaestra.gateway import bridge
from palaestra.gateway.engine_side.generation import FinishReason
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import ChatRenderer, chain_digests, message_digest, normalize_messages
from palaestra.gateway.sessions.trajectory import Turn
from palaestra.models.real_vocab import REAL_VOCAB_FAMILIES, real_vocab_chat_template

# how each template's model writes reasoning ahead of its content (GLM's generation prompt opens the
# think block); what the client sends back is the parsed reply, reasoning as `reasoning_content`
_QWEN = "<think>\n{r}\n</think>\n\n{c}"
_GLM = "{r}</think>{c}"

# Two templates the probe must refuse: each renders the history differently once a turn is
# appended, so the parent's rendering plus a short rendering is not the whole rendering.
_COUNTING = (
    "{{ 'messages=' ~ (messages | length) ~ '\\n' }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LATEST_REASONING = (  # only the last assistant message keeps its reasoning
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content and loop.index0 == ns.last %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _smollm2_template() -> str | None:
    """SmolLM2's template from the built preset (None: not built here; building it converts a GGUF)."""
    from palaestra.models import smollm2
    from palaestra.models.cache import is_built, preset_dir

    where = preset_dir("smollm2-135m", smollm2.VERSION)
    return (where / "chat_template.jinja").read_text() if is_built(where) else None


TEMPLATES = {  # name -> (template text, or how to get it; how reasoning is written; who refuses it)
    "tiny": (None, _QWEN, None),
    "tiny-qwen3": (lambda: real_vocab_chat_template(REAL_VOCAB_FAMILIES["qwen3"]), _QWEN, None),
    "tiny-glm4.7": (lambda: real_vocab_chat_template(REAL_VOCAB_FAMILIES["glm4.7"]), _GLM, None),
    "tiny-glm5": (lambda: real_vocab_chat_template(REAL_VOCAB_FAMILIES["glm5"]), _GLM, None),
    "smollm2-135m": (_smollm2_template, _QWEN, None),
    # its short conversation's history does not render as a prefix of the short request: each call
    "counting": (lambda: _COUNTING, _QWEN, "request"),
    "latest-reasoning": (lambda: _LATEST_REASONING, _QWEN, "probe"),  # the probe finds it out
}
CALC = {
    "type": "function",
    "function": {"name": "calc", "description": "c", "parameters": {"type": "object"}},
}
_TEXT = ["a", "b c", "\n", " lead", "é中", '{"k": 1}', "x" * 30, "<tool_response>", "</tool_response>"]


def _text(rng: random.Random, k: int = 3) -> str:
    return "".join(rng.choices(_TEXT, k=rng.randint(1, k)))


class _Session:
    """A session's turns as the service keeps them (`Session.add_turn`), planned by `plan_chat`."""

    def __init__(self, renderer: ChatRenderer, tools, extra, policy: str) -> None:
        self.renderer, self.tools, self.extra, self.policy = renderer, tools, extra, policy
        self.by_digest: dict[int, list[Turn]] = {}
        self.turns: list[Turn] = []
        self.gaps = bridge.RenderGaps(renderer)
        self.appends = bridge.AppendRenders(renderer)
        self.end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def call(self, messages: list[dict], output_text: str, reply: dict, had_reasoning: bool) -> tuple:
        """Plans `messages` and records the turn whose output is `output_text`; what was planned."""
        digests = chain_digests(messages)
        try:
            plan = bridge.plan_chat(
                self.renderer, self.by_digest, bool(self.turns), messages, digests, self.tools,
                {self.end: "<|im_end|>"}, self.policy, self.extra, 7, self.gaps.get(self.extra), self.appends,
            )  # fmt: skip
        except GatewayError as exc:
            return ("error", str(exc))
        output = self.renderer.encode(output_text)
        turn = Turn(
            len(self.turns), f"c{len(self.turns)}", 0, plan.parent, plan.prompt_ids, output,
            [0.0] * len(output), "v0", [], FinishReason({"type": "stop", "matched": self.end}), 0.0, 0,
            "chat", n_messages=len(messages), digest=digests[-1],
            reply_digest=message_digest(reply, loose_assistant=True), rendered=plan.rendered,
            output_text=output_text, had_reasoning=had_reasoning, context_key=7,
            fork_reason=plan.fork_reason, fork_detail=plan.fork_detail,
        )  # fmt: skip
        self.turns.append(turn)
        if turn.parent is not None:
            turn.parent.children += 1
        self.by_digest.setdefault(turn.digest, []).append(turn)
        parent = plan.parent.turn_id if plan.parent is not None else None
        return (
            list(plan.prompt_ids),
            plan.rendered,
            parent,
            plan.fork_reason,
            plan.fork_detail,
            plan.bridge_tokens,
        )


def _episode(renderer: ChatRenderer, written: str, seed: int) -> list[tuple]:
    """A random session of up to 7 calls: each answer reasons or not and calls a tool or not, the
    client sends back its reasoning or not and appends one or two tool results, a user message (at
    times a wrapped tool response), or both; what every call planned, and the recorded token lists."""
    rng = random.Random(seed)
    tools = [CALC] if rng.random() < 0.7 else None
    extra = rng.choice([None, {"enable_thinking": True}, {"enable_thinking": False}])
    session = _Session(renderer, tools, extra, rng.choice(["strip", "strip", "keep"]))
    messages: list[dict] = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.6 else []
    messages.append({"role": "user", "content": _text(rng)})
    planned = []
    for i in range(rng.randint(3, 7)):
        reasoning = _text(rng) if rng.random() < 0.7 else None
        content = _text(rng) if rng.random() < 0.5 else ""
        args = {"expression": f"{i}+1"}
        calls = tools is not None and rng.random() < 0.8
        output = written.format(r=reasoning, c=content) if reasoning is not None else content
        if calls:
            output += f"\n<tool_call>\n{json.dumps({'name': 'calc', 'arguments': args})}\n</tool_call>"
        output += "<|im_end|>"
        reply: dict = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [
                {"id": f"t{i}", "type": "function", "function": {"name": "calc", "arguments": args}}
            ]
        planned.append(session.call(list(messages), output, reply, reasoning is not None))
        sent = dict(reply)
        if reasoning is not None and rng.random() < 0.8:  # a client that sends the reasoning back
            sent["reasoning_content"] = reasoning
        messages.append(sent)
        appended = rng.choice(["tool", "tool", "tools", "user", "tool+user", "system+tool"])
        if "system" in appended:
            messages.append({"role": "system", "content": _text(rng)})
        for _ in range(2 if appended == "tools" else 1 if "tool" in appended else 0):
            messages.append({"role": "tool", "tool_call_id": f"t{i}", "content": _text(rng)})
        if "user" in appended:  # at times a tool response sent as user text (Qwen3: not a query)
            wrapped = rng.random() < 0.3
            text = f"<tool_response>\n{_text(rng)}\n</tool_response>" if wrapped else _text(rng)
            messages.append({"role": "user", "content": text})
        messages = normalize_messages(messages)
    planned.append([list(t.tokens) for t in session.turns])
    return planned


@pytest.fixture(scope="module")
def renderers(tiny_model_dir):
    """Each template's renderer (the tiny preset's tokenizer: the ids are compared, not the vocabulary)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own: its template is set per renderer
    tiny, out = tok.chat_template, {}
    for name, (template, _, _) in TEMPLATES.items():
        text = template() if template is not None else tiny
        if text is None:
            print(f"[appended] {name}: the preset is not built here, its template left out")
            continue
        tok.chat_template = text  # a renderer compiles its tokenizer's template when it is made
        out[name] = ChatRenderer(tok)
    return out


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_appended_tool_results_plan_as_the_whole_renderings(renderers, name, monkeypatch):
    """Every call of 24 random sessions planned with the appended path and without it (the full
    path, as before) gives the same plan and records; the appended path is taken on the presets'
    templates and refused by the probe on the two that render the history differently."""
    if name not in renderers:
        pytest.skip(f"{name}: the preset is not built here (its template comes from the built preset)")
    renderer, written, refused = renderers[name], TEMPLATES[name][1], TEMPLATES[name][2]
    taken = []
    appended = bridge._bridge_appended

    def counted(*args):
        plan = appended(*args)
        taken.append(plan is not None)
        return plan

    monkeypatch.setattr(bridge, "_bridge_appended", counted)
    fast = [_episode(renderer, written, seed) for seed in range(24)]
    monkeypatch.setattr(bridge, "_bridge_appended", lambda *args: None)
    whole = [_episode(renderer, written, seed) for seed in range(24)]
    for seed, (a, b) in enumerate(zip(fast, whole, strict=True)):
        assert a == b, f"{name}, seed {seed}"
    assert (bridge.append_ok(renderer, None) is None) == (refused == "probe")
    bridged = sum(taken)
    print(f"[appended] {name}: {bridged} of {len(taken)} calls that reached it bridged by the appended path")
    assert bridged == 0 if refused else bridged > 0
