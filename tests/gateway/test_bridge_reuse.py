"""A fork whose request renders to the text of an earlier root turn takes that turn's prompt ids
instead of tokenizing (`bridge._fork`), and a request equal to one the renderer rendered whole lately
takes its rendering and ids (`ChatRenderer.recall`): random conversations against the full path
(render, then tokenize), and the gateway's records of repeated calls (retries, samples of one turn)."""

from __future__ import annotations

import random

import openai
from transformers import AutoTokenizer

from palaestra.gateway import bridge
from palaestra.gateway.engine_side.generation import FinishReason
from palaestra.gateway.renderer import ChatRenderer, chain_digests
from palaestra.gateway.sessions.trajectory import Turn
from tests.support.sessions import CALC, new_session, reward, samples, trajectory

_WORDS = ["a", "b c", " lead", "trail ", "\n", "<|im_end|>", "é中", '{"k": 1}', "", "x" * 40]


def _conversation(rng: random.Random) -> list[dict]:
    """A random request (no assistant turn the session answered: each plans as a fork)."""
    msgs = [{"role": "system", "content": "".join(rng.choices(_WORDS, k=3))}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": "".join(rng.choices(_WORDS, k=rng.randint(1, 5)))})
        msgs.append({"role": "assistant", "content": "".join(rng.choices(_WORDS, k=2))})
    msgs.append({"role": "user", "content": "".join(rng.choices(_WORDS, k=3))})
    return msgs


def _root(plan: bridge.Plan, digest: int, turn_id: int, parent: Turn | None = None) -> Turn:
    """The turn the service records from `plan` (output ids arbitrary, its reply not in the request)."""
    return Turn(
        turn_id, f"c{turn_id}", 0, parent, plan.prompt_ids, [11, 12], [0.0, 0.0], "v0", [],
        FinishReason("stop"), 0.0, 0, "chat", digest=digest, rendered=plan.rendered,
    )  # fmt: skip


class _Counting(ChatRenderer):
    encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


def _plan(renderer, by_digest, msgs, tools=None):
    digests = chain_digests(msgs)
    return bridge.plan_chat(renderer, by_digest, True, msgs, digests, tools, {}), digests[-1]


def test_a_repeated_fork_takes_the_earlier_ids_and_nothing_else_does(tok):
    """Random requests: a repeat of a root's request has the full path's ids without tokenizing (a
    list of its own); a different request filed under the same digest (a hash collision), other
    tools, and a bridged turn that rendered the same text are not taken: tokenized as before."""
    renderer = _Counting(tok)
    renderer._memo = None  # the session's turns alone (the renderer's memo: the test below)
    rng = random.Random(39)
    for case in range(25):
        msgs = _conversation(rng)
        tools = [CALC] if case % 3 == 0 else None
        full = tok.encode(renderer.render(msgs, tools), add_special_tokens=False)
        first, digest = _plan(renderer, {}, msgs, tools)
        root = _root(first, digest, 1)
        by_digest = {digest: [root]}
        before = renderer.encoded
        again, _ = _plan(renderer, by_digest, [dict(m) for m in msgs], tools)
        assert renderer.encoded == before  # taken, not tokenized
        assert again.prompt_ids == full == first.prompt_ids and again.parent is None
        assert again.prompt_ids is not root.tokens and again.rendered == first.rendered
        assert again.fork_reason == first.fork_reason == "prefix_changed"
        # the root's list grows with its chain's later turns: the ids taken are its prompt alone
        root.tokens += [13, 14]
        assert _plan(renderer, by_digest, msgs, tools)[0].prompt_ids == full

        other = [*msgs[:-1], {"role": "user", "content": msgs[-1]["content"] + "!"}]
        collided = {chain_digests(other)[-1]: [root]}
        plan, _ = _plan(renderer, collided, other)
        assert plan.prompt_ids == tok.encode(renderer.render(other, None), add_special_tokens=False)
        assert renderer.encoded == before + 1
        plan, _ = _plan(renderer, by_digest, msgs, None if tools else [CALC])  # other tools
        assert renderer.encoded == before + 2
        assert plan.prompt_ids == tok.encode(plan.rendered, add_special_tokens=False) != full
        # a bridged turn's ids are its parent's + a bridge, not the tokens of its rendering
        child = _root(first, digest, 2, parent=_root(first, 0, 3))
        plan, _ = _plan(renderer, {digest: [child]}, msgs, tools)
        assert renderer.encoded == before + 3 and plan.prompt_ids == full


def test_repeated_calls_record_the_same_samples_as_tokenizing(stack, tok, monkeypatch):
    """The same request sent again and again to one session (retries, samples of one turn): each
    call's prompt is the template's tokens of the request, taken from what the first call kept after
    the first (the tokenizer runs once), and the samples are what they were with both caches off."""
    gw, engine, script = stack
    counting = []
    encode = ChatRenderer.encode
    monkeypatch.setattr(
        ChatRenderer, "encode", lambda self, text: counting.append(text) or encode(self, text)
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]

    renderer = gw.app.state.service.renderer

    def run(scan: int, memo: dict | None) -> list[dict]:
        monkeypatch.setattr(bridge, "_SAME_REQUEST_SCAN", scan)
        monkeypatch.setattr(renderer, "_memo", memo)
        s = new_session(gw)
        client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
        counting.clear()
        for k in range(3):
            script.queue.append(f"answer {k}.")
            client.chat.completions.create(model="tiny", messages=msgs)
        encoded = len(counting)
        turns = trajectory(gw, s["session_id"])["turns"]
        reward(gw, s["session_id"])
        got = [x for x in samples(gw)["samples"] if x["session_id"] == s["session_id"]]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        full = tok.encode(text, add_special_tokens=False)
        assert [t["prompt_ids"] for t in turns] == [full] * 3
        for x in got:
            del x["sample_id"], x["session_id"]
        return got, encoded

    cached, tokenized = run(bridge._SAME_REQUEST_SCAN, {}), run(0, None)
    assert cached[1] == 1 and tokenized[1] == 3
    assert cached[0] == tokenized[0]


def _args(value) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": value}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def test_an_equal_request_takes_the_kept_rendering_and_no_other_does(tok):
    """Random requests planned whole twice: the second takes the first's rendering and ids (a list of
    its own) without rendering; requests `==` finds equal but the template prints otherwise (1, 1.0
    and True; the keys' order), other tools or template arguments are rendered, each as the full
    path renders it; a template that prints the date renders every time."""
    renderer = _Counting(tok)
    rng = random.Random(7)
    plain = [{"role": "user", "content": "add"}]
    variants = [[*plain, _args({"x": v}), {"role": "user", "content": "ok"}] for v in (1, 1.0, True)]
    variants.append([*plain, _args({"y": 2, "x": 1}), {"role": "user", "content": "ok"}])
    variants.append([*plain, _args({"x": 1, "y": 2}), {"role": "user", "content": "ok"}])
    cases = [(_conversation(rng), None, None) for _ in range(20)]
    cases += [(m, [CALC], None) for m in variants] + [(plain, [CALC], {"flag": True}), (plain, None, None)]
    texts = set()
    for msgs, tools, extra in cases:
        full_text = tok.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=True, **(extra or {})
        )
        full = tok.encode(full_text, add_special_tokens=False)
        first = bridge.plan_chat(
            renderer, {}, False, msgs, chain_digests(msgs), tools, {}, template_extra=extra
        )
        assert first.rendered == full_text and first.prompt_ids == full
        texts.add(full_text)
        before = renderer.encoded
        again = bridge.plan_chat(
            renderer, {}, True, [dict(m) for m in msgs], chain_digests(msgs), tools, {}, template_extra=extra
        )
        assert renderer.encoded == before and again.prompt_ids == full and again.rendered == full_text
        assert again.prompt_ids is not first.prompt_ids and again.fork_reason == "prefix_changed"
        again.prompt_ids.append(-1)  # the kept ids are the renderer's own
        assert renderer.recall(renderer.memo_key(msgs, tools, extra))[1] == full
    assert len(texts) == len(cases)  # the variants render apart: a shared key would have mixed them

    dated = AutoTokenizer.from_pretrained(tok.name_or_path)
    dated.chat_template = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatRenderer(dated).memo_key(plain, None, None) is None
