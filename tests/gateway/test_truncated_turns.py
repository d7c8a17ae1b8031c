"""A turn cut at max_tokens is bridged like any other when the client sends its text back: the sampled
ids stay as sampled (trained), the template's closing after them enters as context (loss-masked),
and the session stays one sample. Driven by the real `openai` SDK (chat and Responses) and by the
request shapes Claude Code and Codex send (tests/gateway/test_controls.py), against a scripted
engine (a labelled TEST DOUBLE: `no_end` answers stop at the length limit without an end-of-turn).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from palaestra.gateway import bridge
from palaestra.gateway.engine_side.generation import FinishReason
from palaestra.gateway.renderer import ChatRenderer, normalize_messages
from palaestra.gateway.sessions.trajectory import Turn
from tests.gateway.test_controls import BETAS, claude_code_body, codex_body, events
from tests.support.sessions import new_session, reward, samples, trajectory


def one_sample(gw, engine, sid: str, cut_calls: set[int], end_id: int) -> dict:
    """The session's reward, checked to make one sample whose trained positions are exactly the
    sampled ids of every call, with the end-of-turn after each cut answer in it as context."""
    assert trajectory(gw, sid)["forks"] == []
    assert len(reward(gw, sid)["sample_ids"]) == 1
    (sample,) = [s for s in samples(gw)["samples"] if s["session_id"] == sid]
    tokens, mask = sample["tokens"], [0] * sample["prompt_len"] + sample["loss_mask"]
    sampled = [t for ex in engine.exchanges for t in ex.answer["output_ids"]]
    assert [t for t, m in zip(tokens, mask, strict=True) if m] == sampled
    for i, (ex, nxt) in enumerate(zip(engine.exchanges, engine.exchanges[1:], strict=False)):
        head = ex.body["input_ids"] + ex.answer["output_ids"]
        assert nxt.body["input_ids"][: len(head)] == head  # every call extends the last exactly
        if i in cut_calls:
            assert ex.answer["meta_info"]["finish_reason"]["type"] == "length"
            assert ex.answer["output_ids"][-1] != end_id
            assert tokens[len(head)] == end_id and mask[len(head)] == 0  # the closing: context
    return sample


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_sends_cut_answers_back_and_the_session_stays_one_exact_sample(stack, tok, stream):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}]
    for turn in range(4):
        script.no_end.add(turn)
        script.queue.append(f"one two three four five six seven {turn}")
        if stream:
            chunks = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=5, stream=True
            )
            content, finish = "", None
            for chunk in chunks:
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            reply = {"role": "assistant", "content": content}
        else:
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
            finish, reply = r.choices[0].finish_reason, r.choices[0].message.model_dump(exclude_none=True)
        assert finish == "length"
        messages += [reply, {"role": "user", "content": f"go on ({turn})"}]
    script.queue.append("Done.")
    final = client.chat.completions.create(model="tiny", messages=messages)
    assert final.choices[0].finish_reason == "stop"
    sample = one_sample(gw, engine, s["session_id"], {0, 1, 2, 3}, script.end)
    assert sample["status"] == "completed"
    # the sample is the template's rendering of the whole conversation, cut answers included
    history = normalize_messages(messages + [{"role": "assistant", "content": "Done."}])
    assert tok.decode(sample["tokens"]) == tok.apply_chat_template(history, tokenize=False).rstrip("\n")


def test_a_cut_answer_the_client_changed_forks_as_edited(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    msgs = [{"role": "user", "content": "hello"}]
    script.no_end.add(0)
    script.queue += ["one two three four five", "ok"]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    cut = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and cut and cut != "one two three four five"
    completed = {"role": "assistant", "content": cut + " three"}  # the client finished the text itself
    client.chat.completions.create(
        model="tiny", messages=[*msgs, completed, {"role": "user", "content": "?"}]
    )
    forks = trajectory(gw, s["session_id"])["forks"]
    assert [f["reason"] for f in forks] == ["assistant_edited"]
    assert len(reward(gw, s["session_id"])["sample_ids"]) == 2


def test_openai_responses_sends_an_incomplete_answer_back_and_it_is_bridged(stack, tok):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    items: list = [{"role": "user", "content": "Count."}]
    for turn in range(3):
        script.no_end.add(turn)
        script.queue.append(f"alpha beta gamma delta epsilon {turn}")
        r = client.responses.create(model="tiny", input=items, max_output_tokens=4, store=False)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"role": "user", "content": f"more ({turn})"})
    script.queue.append("Done.")
    assert client.responses.create(model="tiny", input=items, store=False).status == "completed"
    one_sample(gw, engine, s["session_id"], {0, 1, 2}, script.end)


def test_codex_resends_a_cut_answer_and_it_is_bridged(stack):
    gw, engine, script = stack
    s = new_session(gw)
    url, auth = f"{s['base_url']}/responses", {"Authorization": f"Bearer {s['api_key']}"}
    script.no_end.add(0)
    script.queue.append("I will look at the files in the working directory and then close it")
    body = {**codex_body(), "max_output_tokens": 6}
    r = httpx.post(url, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    evs = events(r.text)
    assert evs[-1][0] == "response.incomplete", evs[-1]
    items = evs[-1][1]["response"]["output"]
    # the next turn as Codex sends it with store false: every output item back, without ids
    nxt = codex_body()
    nxt["input"] += [{k: v for k, v in i.items() if k not in ("id", "status")} for i in items]
    nxt["input"].append(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}
    )
    script.queue.append("Done.")
    r = httpx.post(url, json=nxt, headers=auth, timeout=60)
    assert r.status_code == 200 and events(r.text)[-1][0] == "response.completed", r.text
    one_sample(gw, engine, s["session_id"], {0}, script.end)


def test_claude_code_resends_a_cut_answer_and_it_is_bridged(stack):
    gw, engine, script = stack
    s = new_session(gw)
    url = f"{s['base_url']}/messages?beta=true"
    headers = {"x-api-key": s["api_key"], "anthropic-beta": BETAS, "anthropic-version": "2023-06-01"}
    script.no_end.add(0)
    script.queue.append("Listing the files of the repository one by one, starting with")
    first = {**claude_code_body(), "max_tokens": 6}
    r = httpx.post(url, json=first, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    evs = events(r.text)
    stop = next(d["delta"]["stop_reason"] for k, d in evs if k == "message_delta")
    assert stop == "max_tokens"
    text = "".join(d["delta"].get("text", "") for k, d in evs if k == "content_block_delta")
    # the next turn as Claude Code sends it: the answer's blocks back, then the user's next words
    nxt = claude_code_body()
    nxt["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": [{"type": "text", "text": "Please continue."}]},
    ]
    script.queue.append("Done.")
    r = httpx.post(url, json=nxt, headers=headers, timeout=60)
    assert r.status_code == 200 and events(r.text)[-1][0] == "message_stop", r.text
    one_sample(gw, engine, s["session_id"], {0}, script.end)


@pytest.mark.parametrize("ends_with_closing", [False, True])
def test_a_cut_turn_gets_the_closing_once(tok, ends_with_closing):
    """An engine may call an answer whose last allowed token was the end-of-turn `length`: the bridge
    adds the closing only when the sampled ids lack it."""
    renderer = ChatRenderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = tok.encode("Sure", add_special_tokens=False) + ([end] if ends_with_closing else [])
    parent = Turn(
        turn_id=1,
        call_id="c1",
        choice=0,
        parent=None,
        prompt_ids=[1, 2, 3],
        output_ids=out,
        output_logprobs=[-0.1] * len(out),
        weight_version="0",
        weight_spans=[],
        finish_reason=FinishReason.length(len(out)),
        latency_s=0.0,
        cached_tokens=0,
        kind="chat",
    )
    tail = "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    plan = bridge._bridged(renderer, parent, tail, "", {end: "<|im_end|>"})
    assert plan.prompt_ids[: 3 + len(out)] == [1, 2, 3, *out] and plan.parent is parent
    assert tok.decode(plan.prompt_ids[3:]).count("<|im_end|>") == 2  # the cut answer's, the user's


def test_the_zero_engine_cuts_an_answer_at_max_new_tokens():
    """bench/gateway.py's paired test gets its cut answers from the zero-work engine."""
    from fastapi.testclient import TestClient

    from palaestra.testing.zero import make_app

    with TestClient(make_app([5, 6, 7, 2])) as engine:
        for limit, ids, finish in (
            (2, [5, 6], "length"),
            (4, [5, 6, 7, 2], "stop"),
            (None, [5, 6, 7, 2], "stop"),
        ):
            params = {} if limit is None else {"max_new_tokens": limit}
            answer = engine.post("/generate", json={"input_ids": [1], "sampling_params": params}).json()
            assert answer["output_ids"] == ids and answer["meta_info"]["finish_reason"]["type"] == finish
