"""The Responses API and Anthropic Messages dialects, driven by the real `openai` and `anthropic` SDKs.

The engine is `ScriptedEngine` (a labelled TEST DOUBLE, tests/support/servers.py) so the random-weight
`tiny` model can call tools on cue; the gateway, the real Qwen2.5 template of the tiny preset, the
tokenizer and both SDKs are real. Exactness against the real engine is in test_gateway_real_engine.py.
"""

# ruff: noqa: F811 (pytest fixtures imported from test_gateway_bridge are parameters here)
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from palaestra.gateway.parsers import render_tool_call_text
from tests.support.sessions import AUTH, CALC, new_session, reward, samples, trajectory

CALC_RESPONSES = {
    "type": "function",
    "name": "calculator",
    "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
CALC_ANTHROPIC = {
    "name": "calculator",
    "description": "evaluate arithmetic",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}


def calc(expr: str) -> str:
    return render_tool_call_text("hermes", "calculator", json.dumps({"expression": expr}))


def bridged(gw, sid) -> list[dict]:
    traj = trajectory(gw, sid)
    assert traj["forks"] == [], traj["forks"]
    return traj["turns"]


# -- Responses ------------------------------------------------------------------------------------
def test_responses_tool_round_trip_bridges(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue += ["Let me compute.\n" + calc("6*7"), "It is 42."]
    inputs: list = [{"role": "user", "content": "What is 6*7?"}]
    r = client.responses.create(
        model="tiny", instructions="Use tools.", input=inputs, tools=[CALC_RESPONSES], max_output_tokens=64
    )
    kinds = [item.type for item in r.output]
    assert kinds == ["message", "function_call"] and r.status == "completed"
    assert r.output_text == "Let me compute."
    call = r.output[1]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "6*7"}
    inputs += [item.model_dump(exclude_none=True) for item in r.output]
    inputs.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
    r2 = client.responses.create(
        model="tiny", instructions="Use tools.", input=inputs, tools=[CALC_RESPONSES], max_output_tokens=64
    )
    assert r2.output_text == "It is 42." and r2.usage.input_tokens > r.usage.input_tokens
    t1, t2 = bridged(gw, s["session_id"])
    assert t2["parent"] == t1["turn_id"] and t1["call_id"] == r.id and r.id.startswith("resp_")
    first, second = engine.exchanges[-2:]
    assert second.body["input_ids"][: len(first.body["input_ids"])] == first.body["input_ids"]


def test_responses_stream_events_and_previous_response_id(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue += ["Hello there, friend.", "Sure: " + calc("1+1")]
    # tools render into the system prompt: the same tools on every call, or the history changes
    r1 = client.responses.create(model="tiny", input="hi", tools=[CALC_RESPONSES], max_output_tokens=32)
    with client.responses.stream(
        model="tiny",
        input=[{"role": "user", "content": "add 1+1"}],
        previous_response_id=r1.id,
        tools=[CALC_RESPONSES],
        max_output_tokens=64,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
        assert kind in kinds
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output_text == "Sure:" and final.previous_response_id == r1.id
    # the kept conversation was replayed, so the streamed call bridged onto the first
    t1, t2 = bridged(gw, s["session_id"])
    assert t2["parent"] == t1["turn_id"]
    # and the chain goes on from the streamed response
    script.queue.append("Two.")
    r3 = client.responses.create(
        model="tiny",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": final.output[1].call_id, "output": "2"}],
        tools=[CALC_RESPONSES],
        max_output_tokens=16,
    )
    assert r3.output_text == "Two." and len(bridged(gw, s["session_id"])) == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"reasoning": {"effort": "huge"}}, "reasoning"),
        ({"include": ["reasoning.secret"]}, "include"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"tools": [{"type": "local_shell"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_responses_refuses_what_it_does_not_honour(stack, extra, param):
    gw, _, _ = stack
    s = new_session(gw)
    r = httpx.post(
        f"{s['base_url']}/responses",
        json={"model": "tiny", "input": "hi", **extra},
        headers={"Authorization": "Bearer k-test"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == param
        and err["type"] == "invalid_request_error"
        and param.split(".")[0] in err["message"]
    )


# -- Anthropic Messages ----------------------------------------------------------------------------
def test_anthropic_tool_round_trip_bridges(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    script.queue += ["Computing.\n" + calc("2*3"), "Six."]
    messages: list = [{"role": "user", "content": "What is 2*3?"}]
    m = client.messages.create(
        model="tiny", system="Use tools.", messages=messages, tools=[CALC_ANTHROPIC], max_tokens=64
    )
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    use = m.content[1]
    assert use.name == "calculator" and use.input == {"expression": "2*3"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "6"}]},
    ]
    m2 = client.messages.create(
        model="tiny", system="Use tools.", messages=messages, tools=[CALC_ANTHROPIC], max_tokens=64
    )
    assert m2.content[0].text == "Six." and m2.stop_reason == "end_turn" and m2.id.startswith("msg_")
    t1, t2 = bridged(gw, s["session_id"])
    assert t2["parent"] == t1["turn_id"]
    count = client.messages.count_tokens(
        model="tiny", system="Use tools.", messages=messages, tools=[CALC_ANTHROPIC]
    )
    assert count.input_tokens == len(engine.exchanges[-1].body["input_ids"])


def test_anthropic_stream_and_stop_sequences(stack):
    gw, engine, script = stack
    s = new_session(gw)
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    script.queue += ["Step one. " + calc("5-1")]
    with client.messages.stream(
        model="tiny", messages=[{"role": "user", "content": "go"}], tools=[CALC_ANTHROPIC], max_tokens=64
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "Step one." and final.content[1].input == {"expression": "5-1"}
    assert final.usage.output_tokens == len(engine.exchanges[-1].answer["output_ids"])
    # a stop sequence the scripted text contains: the engine is asked to stop there, and says so
    script.queue.append("alpha STOP beta")
    m = client.messages.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stop_sequences=["STOP"], max_tokens=16
    )
    assert engine.exchanges[-1].body["sampling_params"]["stop"] == ["STOP"]
    assert m.stop_reason in ("end_turn", "stop_sequence")


def test_anthropic_errors_and_x_api_key(stack):
    gw, _, _ = stack
    s = new_session(gw)
    url = f"{s['base_url']}/messages"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    no_key = httpx.post(url, json=body)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert no_key.json()["type"] == "error"
    ok = httpx.post(url, json=body, headers={"x-api-key": "k-test", "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    for bad, field in (
        ({k: v for k, v in body.items() if k != "max_tokens"}, "max_tokens"),
        ({**body, "thread": {"type": "create"}}, "thread"),
        ({**body, "temperature": 1.5}, "temperature"),
        ({**body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({**body, "tools": [{"type": "bash_19990101", "name": "bash"}]}, "tools"),
    ):
        r = httpx.post(url, json=bad, headers={"x-api-key": "k-test"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"]
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            extra_body={"temperature": 1.5},
        )
    missing = httpx.post(f"{gw.url}/s/nope/v1/messages", json=body, headers={"x-api-key": "k-test"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_one_session_mixes_the_three_dialects(stack):
    """Chat, then Responses, then Messages on one conversation: one bridged trajectory, one sample."""
    gw, engine, script = stack
    s = new_session(gw)
    script.queue += ["One.", "Two.", "Three."]
    oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    history = [{"role": "user", "content": "count"}]
    c = oa.chat.completions.create(model="tiny", messages=history, max_tokens=8)
    history += [
        {"role": "assistant", "content": c.choices[0].message.content},
        {"role": "user", "content": "on"},
    ]
    r = oa.responses.create(model="tiny", input=history, max_output_tokens=8)
    history += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": "more"}]
    an = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    m = an.messages.create(model="tiny", messages=history, max_tokens=8)
    assert m.content[0].text == "Three."
    turns = bridged(gw, s["session_id"])
    assert [t["parent"] for t in turns] == [None, turns[0]["turn_id"], turns[1]["turn_id"]]
    assert len(reward(gw, s["session_id"])["sample_ids"]) == 1


def test_streamed_calls_feed_the_overhead_histogram_and_record_their_engine_latency(stack):
    """`call_overhead_seconds` is the gateway's time per call outside the engine: every harness
    streams, so a streamed call counts too (it did not: issue 37), with the engine's time left out,
    and its turn records the engine's latency (it recorded 0)."""
    gw, engine, script = stack
    engine.delay_s = 0.5
    s = new_session(gw)
    base, key = s["base_url"], {"Authorization": "Bearer k-test"}
    msgs = [{"role": "user", "content": "hi"}]
    calls = [
        ("chat/completions", {"messages": msgs, "max_tokens": 8, "stream": True}),
        ("responses", {"input": "hi", "max_output_tokens": 8, "stream": True}),
        ("messages", {"messages": msgs, "max_tokens": 8, "stream": True}),
        ("chat/completions", {"messages": msgs, "max_tokens": 8}),
    ]

    def overhead() -> tuple[float, float]:
        rows = httpx.get(f"{gw.url}/metrics", headers=AUTH).text.splitlines()
        value = {
            r.split()[0]: float(r.split()[1]) for r in rows if r.startswith("palaestra_gateway_call_overhead")
        }
        return value["palaestra_gateway_call_overhead_seconds_count"], value[
            "palaestra_gateway_call_overhead_seconds_sum"
        ]

    for route, body in calls:
        script.queue.append("Fine.")
        count, total = overhead()
        r = httpx.post(f"{base}/{route}", json=body, headers=key, timeout=60)
        assert r.status_code == 200, r.text
        after = overhead()
        assert after[0] == count + 1, (route, body)
        assert 0 < after[1] - total < engine.delay_s, (route, after[1] - total)  # the engine's wait left out
    turns = trajectory(gw, s["session_id"])["turns"]
    assert len(turns) == 4 and all(t["latency_s"] >= engine.delay_s for t in turns), turns


def test_a_turn_sampled_under_a_constraint_is_marked_in_its_sample(stack):
    """The engine reports a constrained turn's logprobs from the grammar-masked distribution: the
    turn says so, and its sample marks exactly its tokens (`Sample.constrained`), so the trainer
    leaves them out of the mismatch metrics and TIS / RS (tests/trainer/test_constrained.py)."""
    gw, engine, script = stack
    s = new_session(gw)
    script.queue += ['{"a": 1}', "Done."]
    oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    history = [{"role": "user", "content": "json please"}]
    c = oa.chat.completions.create(
        model="tiny", messages=history, max_tokens=16, response_format={"type": "json_object"}
    )
    history += [
        {"role": "assistant", "content": c.choices[0].message.content},
        {"role": "user", "content": "ok"},
    ]
    oa.chat.completions.create(model="tiny", messages=history, max_tokens=16)
    first, second = bridged(gw, s["session_id"])
    assert first["constrained"] is True and second["constrained"] is False
    reward(gw, s["session_id"])
    (sample,) = [x for x in samples(gw)["samples"] if x["session_id"] == s["session_id"]]
    n1, n2 = len(first["output_ids"]), len(second["output_ids"])
    marks = [m for m, sampled in zip(sample["constrained"], sample["loss_mask"], strict=True) if sampled]
    assert marks == [1] * n1 + [0] * n2


# -- parse status ----------------------------------------------------------------------------------
def test_malformed_tool_calls_come_back_as_content_in_every_dialect(stack, tok):
    gw, engine, script = stack
    s = new_session(gw)
    broken = '<tool_call>\n{"name": "calculator", "arguments": {broken\n</tool_call>'
    script.queue += ["Trying. " + broken, "Fine. " + broken, "Again. " + broken, "ok " + calc("1")]
    oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    an = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    chat = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], tools=[CALC], max_tokens=64
    )
    assert chat.choices[0].finish_reason == "stop" and "broken" in chat.choices[0].message.content
    resp = oa.responses.create(model="tiny", input="b", tools=[CALC_RESPONSES], max_output_tokens=64)
    assert [i.type for i in resp.output] == ["message"] and "broken" in resp.output_text
    msg = an.messages.create(
        model="tiny", messages=[{"role": "user", "content": "c"}], tools=[CALC_ANTHROPIC], max_tokens=64
    )
    assert msg.stop_reason == "end_turn" and "broken" in msg.content[0].text
    good = an.messages.create(
        model="tiny", messages=[{"role": "user", "content": "d"}], tools=[CALC_ANTHROPIC], max_tokens=64
    )
    assert good.stop_reason == "tool_use"
    traj = trajectory(gw, s["session_id"])
    assert traj["parse_errors"] == {"malformed_json": 3}
    for turn in traj["turns"][:3]:
        (error,) = turn["parse"]["errors"]
        assert error["reason"] == "malformed_json" and turn["parse"]["tool_calls"] == 0
        a, b = error["span"]
        assert tok.decode(turn["output_ids"][a:b]).startswith("<tool_call>")
        assert tok.decode(turn["output_ids"][a:b]).rstrip().endswith("</tool_call>")
    assert traj["turns"][3]["parse"] == {"tool_calls": 1, "reasoning": "off", "errors": []}
    metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer k-test"}).text
    assert 'palaestra_gateway_parse_errors_total{reason="malformed_json"} 3.0' in metrics


# -- structured output -----------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_output_formats_map_to_sglang_constraints(stack):
    gw, engine, script = stack
    s = new_session(gw)
    oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    script.queue += ['{"answer": 4}'] * 4
    oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "2+2?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
        },
    )
    assert json.loads(engine.exchanges[-1].body["sampling_params"]["json_schema"]) == SCHEMA
    oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
    )
    assert json.loads(engine.exchanges[-1].body["sampling_params"]["json_schema"]) == {"type": "object"}
    r = oa.responses.create(
        model="tiny", input="2+2?", text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}
    )
    assert json.loads(engine.exchanges[-1].body["sampling_params"]["json_schema"]) == SCHEMA
    assert r.text.format.type == "json_schema"
    oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "y"}], extra_body={"regex": "[0-9]+"}
    )
    assert engine.exchanges[-1].body["sampling_params"]["regex"] == "[0-9]+"
    for bad, param in (
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format"),
    ):
        r = httpx.post(
            f"{s['base_url']}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "z"}], **bad},
            headers={"Authorization": "Bearer k-test"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- replies come back unchanged (the seam's rule), without a server ---------------------------------
def _out(content, reasoning=None, calls=()):
    from palaestra.gateway.dialect import TurnOutput
    from palaestra.gateway.parsers import ToolCall

    tool_calls = [ToolCall(f"call_{i}", "calculator", json.dumps(a)) for i, a in enumerate(calls)]
    return TurnOutput(
        0, "", content, reasoning, tool_calls, "tool_calls" if calls else "stop", None, [1], None, "v", 0
    )


@pytest.mark.parametrize(
    "out",
    [
        _out("Hello."),
        _out(None, calls=[{"expression": "1+1"}]),
        _out("Let me.", reasoning="think first", calls=[{"expression": "2"}, {"expression": "3"}]),
        _out("", reasoning="only thought"),
    ],
)
def test_replies_sent_back_are_the_recorded_message(out):
    from palaestra.gateway.dialect import TurnRequest, TurnResult, reply_message
    from palaestra.gateway.dialects import anthropic_api, responses_answer, responses_api

    result = TurnResult("resp_abc", 0, "tiny", 3, [out])
    expected = reply_message(out)
    request = responses_api.parse({"input": "q"})
    items = responses_answer.answer(request, result)["output"]
    back = responses_api.parse({"input": [{"role": "user", "content": "q"}, *items]})
    assert back.messages[-1] == expected
    request = anthropic_api.parse({"messages": [{"role": "user", "content": "q"}], "max_tokens": 4})
    blocks = anthropic_api.answer(request, TurnResult("msg_abc", 0, "tiny", 3, [out]))["content"]
    back = anthropic_api.parse(
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": blocks}],
            "max_tokens": 4,
        }
    )
    assert back.messages[-1] == expected
    assert isinstance(request, TurnRequest)


def test_with_a_reasoning_parser_a_streamed_call_is_answered_whole_by_the_engine(tok, tmp_path):
    """Reasoning is parsed at the end, so no text can go out before the answer is whole: the engine
    is asked for the whole answer (no stream of one chunk per token), and each SDK's stream carries
    the same reasoning and text as the unstreamed answer; an engine failure is the stream's error."""
    from tests.support.servers import ScriptedEngine, TextScript, ThreadServer, gateway_server

    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path / "spool", tok, reasoning_parser="qwen3") as gw,
    ):
        s = new_session(gw)
        msgs = [{"role": "user", "content": "hi"}]
        script.queue += ["<think>\nhmm\n</think>\n\nFine."] * 4
        oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
        whole = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=32).choices[0].message
        chunks = list(oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=32, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.content == "Fine."
        an = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
        with an.messages.stream(model="tiny", messages=msgs, max_tokens=32) as stream:
            blocks = stream.get_final_message().content
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] == [
            ("thinking", "hmm"),
            ("text", "Fine."),
        ]
        assert [bool(e.body.get("stream")) for e in engine.exchanges] == [False, False, False]
        engine.fail_next = 3  # every attempt refused: the stream ends with the engine's error
        r = httpx.post(
            f"{s['base_url']}/messages",
            json={"messages": msgs, "max_tokens": 8, "stream": True},
            headers={"x-api-key": "k-test"},
            timeout=60,
        )
        assert r.status_code == 200 and r.text.rstrip().splitlines()[-2] == "event: error", r.text


def test_without_a_reasoning_parser_a_think_tag_streams_as_content(stack, tok):
    """The tiny preset's template has no reasoning parser, so a `<think>` the model writes is content:
    what a stream may send of an answer is the text after it too, not held until the answer ends (it
    was: the stream stalled at the tag), and each SDK's stream adds up to the unstreamed answer."""
    from types import SimpleNamespace

    gw, engine, script = stack
    svc = gw.app.state.service
    assert svc.reasoning_parser is None
    # what the stream's holdback lets out of the answer so far (no tools, no stop strings)
    call = SimpleNamespace(request=SimpleNamespace(tools_on=False, params=SimpleNamespace(stop=[])))
    so_far = tok.encode("Sure. <think> one two three", add_special_tokens=False)
    assert svc._held_back(call).advance(so_far) == "Sure. <think> one two three"
    s = new_session(gw)
    msgs = [{"role": "user", "content": "hi"}]
    answer = "Sure. <think> one two three four five six seven eight"
    script.queue += [answer] * 3
    oa = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    whole = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=64).choices[0].message
    assert whole.content == answer
    chunks = list(oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    an = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    with an.messages.stream(model="tiny", messages=msgs, max_tokens=64) as stream:
        texts = [
            e.delta.text for e in stream if e.type == "content_block_delta" and e.delta.type == "text_delta"
        ]
    assert "".join(texts) == answer
