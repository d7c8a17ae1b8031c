"""Turn bridging and forks, driven by the real `openai` SDK against a scripted engine (a labelled test double).

The scripted engine answers with token ids the test chooses, so the random-weight `tiny` model can
"call tools" and end turns on cue; everything else (the gateway, the real Qwen2.5 chat template of the
tiny preset, the tokenizer, the openai SDK) is real.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from palaestra.gateway.app import create_app
from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.gateway.renderer import normalize_messages
from tests.support.servers import ScriptedEngine, TextScript, ThreadServer, gateway_server
from tests.support.sessions import CALC, new_session, reward, samples, trajectory


def test_thirty_turn_tool_conversation_is_one_exact_sample(stack, tok):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    messages = [
        {"role": "system", "content": "You are a calculator agent. " * 40},  # a long system prompt
        {"role": "user", "content": "Add the numbers 1..30 one call at a time."},
    ]
    for turn in range(30):
        script.queue.append(
            render_tool_call_text("hermes", "calculator", json.dumps({"expression": f"{turn}+1"}))
        )
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
            "expression": f"{turn}+1"
        }
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(turn + 1)})
    script.queue.append("The total is 465.")
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
    assert final.choices[0].message.content == "The total is 465."
    traj = trajectory(gw, s["session_id"])
    assert traj["forks"] == [] and len(traj["turns"]) == 31
    # every engine call carried the routing key, and each prompt extends the previous prompt + output exactly
    for i, ex in enumerate(engine.exchanges):
        assert ex.headers["x-smg-routing-key"] == s["session_id"]
        if i:
            prev = engine.exchanges[i - 1]
            assert (
                ex.body["input_ids"][: len(prev.body["input_ids"]) + len(prev.answer["output_ids"])]
                == prev.body["input_ids"] + prev.answer["output_ids"]
            )
    # the first prompt is exactly the template's rendering
    first = tok.apply_chat_template(messages[:2], tools=[CALC], tokenize=False, add_generation_prompt=True)
    assert engine.exchanges[0].body["input_ids"] == tok.encode(first, add_special_tokens=False)
    done = reward(gw, s["session_id"], 1.0, metrics={"correct": 1.0})
    assert len(done["sample_ids"]) == 1
    sample = samples(gw)["samples"][0]
    last = engine.exchanges[-1]
    assert sample["tokens"] == last.body["input_ids"] + last.answer["output_ids"]
    sampled = sum(len(ex.answer["output_ids"]) for ex in engine.exchanges)
    assert sum(sample["loss_mask"]) == sampled and sample["reward"] == 1.0 and sample["status"] == "completed"
    lp = [x for x, m in zip(sample["rollout_logprobs"], sample["loss_mask"], strict=True) if m]
    assert lp == [e[0] for ex in engine.exchanges for e in ex.answer["meta_info"]["output_token_logprobs"]]
    # the rendered template of the whole conversation equals the sample's tokens where the model spoke,
    # i.e. bridging introduced no drift: decode and compare with the template text
    # (templates want tool-call arguments as objects; OpenAI clients send JSON strings)
    history = normalize_messages(messages + [{"role": "assistant", "content": "The total is 465."}])
    full = tok.apply_chat_template(history, tools=[CALC], tokenize=False)
    assert tok.decode(sample["tokens"]) == full.rstrip("\n")


@pytest.mark.parametrize("reason", ["prefix_changed", "assistant_edited", "branched"])
def test_each_fork_reason(stack, reason):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    msgs = [{"role": "user", "content": "hello"}]
    script.queue += ["first answer", "second answer", "third answer"]
    r = client.chat.completions.create(model="tiny", messages=msgs)
    reply = {"role": "assistant", "content": r.choices[0].message.content}
    if reason == "prefix_changed":
        nxt = [{"role": "user", "content": "hello, edited"}, reply, {"role": "user", "content": "more"}]
    elif reason == "assistant_edited":
        nxt = msgs + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "more"}]
    else:
        nxt = msgs + [reply, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=nxt)
    if reason == "branched":
        client.chat.completions.create(
            model="tiny", messages=msgs + [reply, {"role": "user", "content": "other"}]
        )
    traj = trajectory(gw, s["session_id"])
    assert [f["reason"] for f in traj["forks"]] == [reason]
    done = reward(gw, s["session_id"])
    assert len(done["sample_ids"]) == 2
    got = [x for x in samples(gw)["samples"] if x["session_id"] == s["session_id"]]
    assert {x["group_id"] for x in got} == {"test/t"}
    assert sorted((x["fork_reason"] or "") for x in got) == sorted(["", reason])
    metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer k-test"}).text
    assert f'palaestra_gateway_forks_total{{reason="{reason}"}} 1.0' in metrics


def test_streaming_tool_call_round_trip(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue.append(
        "Let me compute.\n" + render_tool_call_text("hermes", "calculator", '{"expression": "6*7"}')
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "6*7?"}],
        tools=[CALC],
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert "<tool_call>" not in content and content.strip() == "Let me compute."
    assert finish == "tool_calls" and calls[0].function.name == "calculator"
    assert json.loads(calls[0].function.arguments) == {"expression": "6*7"}
    assert usage is not None and usage.completion_tokens == len(engine.exchanges[-1].answer["output_ids"])


def test_malformed_tool_call_is_plain_content(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue.append('<tool_call>\n{"name": "calculator", "arguments": {broken\n</tool_call>')
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], tools=[CALC]
    )
    assert r.choices[0].message.tool_calls in (None, []) and "broken" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_engine_failure_is_a_clear_error_and_marks_the_session(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test", max_retries=0)
    engine.fail_next = 10  # more than the gateway's retries
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503 and "engine" in str(err.value)
    engine.fail_next = 1  # one failure is retried (no token was committed)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content
    done = reward(gw, s["session_id"])
    assert done["status"] == "failed"  # the trainer can drop it
    assert len(trajectory(gw, s["session_id"])["failed_calls"]) == 1


def test_auth_and_bad_input(stack):
    gw, _, script = stack
    s = new_session(gw)
    bad = openai.OpenAI(base_url=s["base_url"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test", max_retries=0)
    cases = [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
        (
            dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}]),
            "tools[0]",
        ),
        # (a max_tokens beyond the context is clamped by default: tests/gateway/test_controls.py)
        (dict(messages=[{"role": "user", "content": "x"}], max_tokens=0), "max_tokens"),
        (dict(messages=[{"role": "user", "content": "x"}], extra_body={"frobnicate": 1}), "Unrecognized"),
        (dict(messages=[{"role": "user", "content": "x"}], temperature=7), "temperature"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", **kwargs)
        assert needle in str(err.value)
    r = httpx.post(
        f"{s['base_url']}/chat/completions", content=b"{nope", headers={"Authorization": "Bearer k-test"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    missing = openai.OpenAI(base_url=f"{gw.url}/s/nope/v1", api_key="k-test", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        missing.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(f"{gw.url}/health").status_code == 200
    admin = httpx.post(f"{gw.url}/admin/pause", headers={"Authorization": "Bearer k-test"})
    assert admin.status_code == 403  # the environment key is not the admin key (tests/gateway/test_keys.py)
    script.queue.append("still serving")
    assert (
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        .choices[0]
        .message.content
        == "still serving"
    )


def test_content_parts_null_content_and_template_kwargs(stack, tok):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue += [render_tool_call_text("hermes", "calculator", '{"expression": "1"}'), "done"]
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "sys "}, {"type": "text", "text": "prompt"}]},
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        tools=[CALC],
        tool_choice="required",
        parallel_tool_calls=False,
        response_format={"type": "text"},
        user="u1",
        stop=["\n\n\n"],
        seed=3,
        n=1,
    )
    call = r.choices[0].message.tool_calls[0]
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "1"},
    ]
    r2 = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        tools=[CALC],
        tool_choice={"type": "function", "function": {"name": "calculator"}},
    )
    assert r2.choices[0].message.content == "done"
    assert trajectory(gw, s["session_id"])["forks"] == []
    first = engine.exchanges[0].body
    assert first["sampling_params"]["sampling_seed"] == 3 and first["sampling_params"]["stop"] == ["\n\n\n"]
    assert "sys prompt" in tok.decode(first["input_ids"])


def test_langchain_tool_calls_round_trip(stack):
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    gw, engine, script = stack
    s = new_session(gw)
    llm = ChatOpenAI(base_url=s["base_url"], api_key="k-test", model="tiny").bind_tools([CALC])
    script.queue += [render_tool_call_text("hermes", "calculator", '{"expression": "9*9"}'), "81."]
    first = llm.invoke("What is 9*9?")
    call = first.tool_calls[0]
    assert call["name"] == "calculator" and call["args"] == {"expression": "9*9"}
    second = llm.invoke(["What is 9*9?", first, ToolMessage(content="81", tool_call_id=call["id"])])
    assert second.content == "81."
    assert trajectory(gw, s["session_id"])["forks"] == []  # LangChain's echo of the call bridges


def test_samples_stream_and_pause_reject_mode(tok, tmp_path):
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path, tok, pause_mode="reject", retry_after_s=7) as gw:
            s = new_session(gw)
            client = openai.OpenAI(base_url=s["base_url"], api_key="k-test", max_retries=0)
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
            admin = {"Authorization": "Bearer k-admin"}
            assert httpx.post(f"{gw.url}/admin/pause", headers=admin).json()["paused"] is True
            r = httpx.post(
                f"{s['base_url']}/chat/completions",
                headers={"Authorization": "Bearer k-test"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "y"}]},
            )
            assert r.status_code == 429 and r.headers["retry-after"] == "7"
            httpx.post(f"{gw.url}/admin/resume", headers=admin)
            done = reward(gw, s["session_id"])
            with httpx.stream(
                "GET",
                f"{gw.url}/samples/stream",
                params={"after": 0, "heartbeat_s": 1},
                headers={"Authorization": "Bearer k-test"},
                timeout=10,
            ) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        assert json.loads(line[6:])["sample_id"] == done["sample_ids"][0]
                        break


def test_gateway_refuses_to_start_without_keys(tok, tmp_path, monkeypatch):
    monkeypatch.delenv("PALAESTRA_API_KEY", raising=False)
    monkeypatch.delenv("PALAESTRA_ADMIN_KEY", raising=False)
    with pytest.raises(SystemExit, match="--insecure-local"):
        create_app(
            GatewayConfig(
                model="tiny", engine_url="http://127.0.0.1:9", spool_dir=str(tmp_path), context_length=4096
            ),
            tokenizer=tok,
        )
    monkeypatch.setenv("PALAESTRA_API_KEY", "from-env")
    monkeypatch.setenv("PALAESTRA_ADMIN_KEY", "admin-env")
    app = create_app(
        GatewayConfig(
            model="tiny", engine_url="http://127.0.0.1:9", spool_dir=str(tmp_path), context_length=4096
        ),
        tokenizer=tok,
    )
    assert app.state.service.config.api_key == "from-env"
