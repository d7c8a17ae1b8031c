"""The dialect seam: OpenAI request parsing, OpenAI answer shaping, stream holdback, and a second dialect.

The shaping tests build `TurnResult`s by hand (the shapers are pure functions of them). The last
tests drive `GatewayService` with a TEST-ONLY dialect (a made-up wire format, not a planned one)
against `ScriptedEngine` (a labelled test double of the engine; see tests/support/servers.py) and
the real tiny tokenizer and chat template, to show the core needs nothing OpenAI-specific.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from palaestra.gateway.app import build_service
from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.dialect import (
    Dialect,
    GenerationParams,
    StreamEvent,
    StreamFailed,
    StreamFinished,
    StreamStarted,
    TextDelta,
    TextRequest,
    TokenLogprob,
    TurnOutput,
    TurnRequest,
    TurnResult,
    reply_message,
)
from palaestra.gateway.dialects import openai_request, openai_response
from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.parsers import ToolCall
from palaestra.gateway.renderer import message_digest, normalize_messages
from palaestra.gateway.sessions.session import Session
from palaestra.gateway.sessions.spool import SampleSpool
from palaestra.gateway.streaming import HeldBackText, safe_prefix, sse
from tests.support.servers import ScriptedEngine, ThreadServer

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def params(**kw: Any) -> GenerationParams:
    base: dict[str, Any] = dict(
        sampling={}, n=1, stream=False, include_usage=False, logprobs=False, top_logprobs=0, stop=[]
    )
    return GenerationParams(**{**base, "max_tokens": None, **kw})


def output(index: int = 0, **kw: Any) -> TurnOutput:
    base: dict[str, Any] = dict(
        index=index,
        text="hi",
        content="hi",
        reasoning=None,
        tool_calls=[],
        finish="stop",
        stop_matched=7,
        token_ids=[1, 2, 7],
        logprobs=None,
        weight_version="v3",
        cached_tokens=4,
    )
    return TurnOutput(**{**base, **kw})


def result(*outputs: TurnOutput) -> TurnResult:
    return TurnResult("chatcmpl-x", 1700000000, "tiny", 10, list(outputs) or [output()])


def chat_request(**kw: Any) -> TurnRequest:
    return TurnRequest([{"role": "user", "content": "q"}], None, "none", params(**kw))


# -- openai_response: pure shaping --------------------------------------------------------------
@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "stop"), ("length", "length"), ("abort", "stop"), ("tool_calls", "tool_calls"), ("x", "stop")],
)
def test_finish_reason_mapping(finish, expected):
    assert openai_response.finish_reason(output(finish=finish)) == expected


def test_usage_sums_choices_and_reports_cached_tokens_of_the_first():
    r = result(output(0, token_ids=[1, 2, 3], cached_tokens=4), output(1, token_ids=[5], cached_tokens=9))
    assert openai_response.usage(r) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_chat_logprobs_bytes_and_alternatives():
    entries = [TokenLogprob("é", -0.5, [("é", -0.5), ("e", -1.25)]), TokenLogprob("!", -0.1)]
    shaped = openai_response.chat_logprobs(entries)
    assert shaped["refusal"] is None
    first, second = shaped["content"]
    assert first["token"] == "é" and first["logprob"] == -0.5 and first["bytes"] == [0xC3, 0xA9]
    assert first["top_logprobs"] == [
        {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
        {"token": "e", "logprob": -1.25, "bytes": [0x65]},
    ]
    assert second["top_logprobs"] == []


def test_chat_completion_with_tool_calls_and_reasoning():
    call = ToolCall("call_1", "calc", '{"x": 1}')
    out = output(content=None, reasoning="think", tool_calls=[call], finish="tool_calls")
    body = openai_response.chat_completion(chat_request(), result(out))
    assert body["id"] == "chatcmpl-x" and body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "v3" and body["model"] == "tiny" and body["created"] == 1700000000
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["logprobs"] is None
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
        ],
        "reasoning_content": "think",
    }
    assert "reasoning_content" not in openai_response.message(output())


@pytest.mark.parametrize(
    "out",
    [
        output(),
        output(content=None, tool_calls=[ToolCall("call_1", "calc", '{"x": [1, "é"]}')], finish="tool_calls"),
        output(content="see:", tool_calls=[ToolCall("call_2", "calc", "not json")], reasoning="hmm"),
        output(content="", reasoning=None),
    ],
)
def test_openai_reply_normalises_to_the_recorded_reply(out):
    """The bridge rule of dialect.py for OpenAI: the message an agent echoes back is, once
    normalised, exactly the internal reply the core digests (else every turn would fork)."""
    echoed = normalize_messages([json.loads(json.dumps(openai_response.message(out)))])[0]
    assert echoed == reply_message(out)
    assert message_digest(echoed, loose_assistant=True) == message_digest(
        reply_message(out), loose_assistant=True
    )


def test_text_completion_offsets():
    out = output(text="ab c", logprobs=[TokenLogprob("ab", -1.0), TokenLogprob(" c", -2.0)], finish="length")
    body = openai_response.text_completion(TextRequest("ab", params(logprobs=True)), result(out))
    (choice,) = body["choices"]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["ab", " c"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": None,
        "text_offset": [0, 2],
    }


def shaped(request: TurnRequest, events: list[StreamEvent]) -> list[Any]:
    async def feed() -> AsyncGenerator[StreamEvent, None]:
        for e in events:
            yield e

    async def collect() -> list[str]:
        return [c async for c in openai_response.chat_stream(request, feed())]

    # a piece's events may go out as one chunk: split the stream's text into its events
    text = "".join(asyncio.run(collect()))
    assert text.endswith("\n\n")
    lines = [event + "\n\n" for event in text.split("\n\n")[:-1]]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:-2] if line == "data: [DONE]\n\n" else json.loads(line[6:]) for line in lines]


def test_chat_stream_event_order_and_usage_chunk():
    call = ToolCall("call_1", "calc", "{}")
    out = output(content="Hello world", reasoning="r", tool_calls=[call], finish="tool_calls")
    events: list[StreamEvent] = [
        StreamStarted("chatcmpl-x", 5, "tiny", 10),
        TextDelta("Hello", [TokenLogprob("Hello", -0.25)]),
        StreamFinished(result(out), unsent=" world"),
    ]
    chunks = shaped(chat_request(include_usage=True, logprobs=True), events)
    assert chunks[-1] == "[DONE]"
    role, delta, reasoning, rest, tools, finish, usage = chunks[:-1]
    assert all(c["id"] == "chatcmpl-x" and c["created"] == 5 and c["model"] == "tiny" for c in chunks[:-1])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert delta["choices"][0]["delta"] == {"content": "Hello"}
    assert delta["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25
    assert reasoning["choices"][0]["delta"] == {"reasoning_content": "r"}
    assert rest["choices"][0]["delta"] == {"content": " world"}
    assert tools["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    ]
    assert finish["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 13

    without = shaped(chat_request(), [events[0], StreamFinished(result(output()), unsent="")])
    assert [c if c == "[DONE]" else c["choices"][0]["delta"] for c in without] == [
        {"role": "assistant", "content": ""},
        {},
        "[DONE]",
    ]


def test_chat_stream_failure_is_an_error_event_then_done():
    err = GatewayError("the engine timed out", 504, code="engine_timeout")
    chunks = shaped(chat_request(), [StreamStarted("c", 1, "tiny", 3), StreamFailed(err)])
    assert chunks[1] == {
        "error": {
            "message": "the engine timed out",
            "type": "server_error",
            "param": None,
            "code": "engine_timeout",
        }
    }
    assert chunks[2:] == ["[DONE]"]


# -- streaming: holdback and framing -------------------------------------------------------------
def test_safe_prefix_holds_back_markers_stops_and_partial_characters():
    assert safe_prefix("Hi <tool_call>{", ["<tool_call>"], []) == "Hi "
    assert safe_prefix("Hi <tool", ["<tool_call>"], []) == "Hi "  # a marker may be arriving
    assert safe_prefix("Hi <b>", ["<tool_call>"], []) == "Hi <b>"
    assert safe_prefix("one two END three", [], ["END"]) == "one two "
    assert safe_prefix("one two E", [], ["END"]) == "one two "
    assert safe_prefix("caf\ufffd", [], []) == "caf"


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
    assert sse({"a": 1}, event="message_stop") == 'event: message_stop\ndata: {"a": 1}\n\n'


def test_held_back_text_never_sends_tool_markup(tok):
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    held = HeldBackText(lambda i: tok.decode(i, skip_special_tokens=False), ["<tool_call>", "<think>"], [])
    sent = "".join(held.advance(ids[:k]) for k in range(1, len(ids) + 1))
    assert sent == held.sent and text.startswith(sent) and "<" not in sent
    assert sent.startswith("Let me compute.")
    assert held.unsent("Let me compute.") == "Let me compute."[len(sent) :]
    assert held.unsent("Something else") == ""  # what went out cannot be taken back


# -- openai_request: the parser -----------------------------------------------------------------
def test_parse_chat_fills_the_turn_request():
    req = openai_request.parse_chat(
        {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}],
            "tools": [CALC],
            "tool_choice": {"type": "function", "function": {"name": "calc"}},
            "chat_template_kwargs": {"enable_thinking": False},
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 3,
        }
    )
    assert req.messages == [{"role": "system", "content": "be brief"}]
    assert req.tool_choice == "named" and req.named_tool == "calc" and req.tools_on
    assert req.template_kwargs == {"enable_thinking": False}
    p = req.params
    assert p.stream and p.include_usage and p.logprobs and p.top_logprobs == 2
    assert p.sampling["sampling_seed"] == 3
    assert not openai_request.parse_chat({"messages": [{"role": "user", "content": "x"}]}).tools_on


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
    ],
)
def test_parse_chat_errors_name_the_field(body, param):
    with pytest.raises(GatewayError) as err:
        openai_request.parse_chat(body)
    assert err.value.status == 400 and err.value.param == param


def test_parse_completion():
    assert openai_request.parse_completion({"prompt": ["once"]}).prompt == "once"
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "stream": True}, "stream")):
        with pytest.raises(GatewayError) as err:
            openai_request.parse_completion(body)
        assert err.value.param == param


# -- the seam: a second (test-only) dialect through the unchanged core ---------------------------
def toy_parse(body: dict[str, Any]) -> TurnRequest:
    """TEST-ONLY wire format: {"turns": [[role, text], ...], "stream": bool}."""
    messages = [{"role": r, "content": t} for r, t in body["turns"]]
    return TurnRequest(messages, None, "none", params(stream=bool(body.get("stream"))))


def toy_answer(request: TurnRequest, res: TurnResult) -> dict[str, Any]:
    out = res.outputs[0]
    return {"said": out.content, "why": out.finish, "id": res.call_id, "tokens": res.completion_tokens}


async def toy_stream(
    request: TurnRequest, events: AsyncGenerator[StreamEvent, None]
) -> AsyncGenerator[str, None]:
    async for e in events:
        if isinstance(e, TextDelta):
            yield sse({"more": e.text}, event="delta")
        elif isinstance(e, StreamFinished):
            yield sse({"rest": e.unsent, "why": e.result.outputs[0].finish}, event="end")


TOY = Dialect("toy-", toy_parse, toy_answer, toy_stream)


def test_a_second_dialect_runs_on_the_same_core(tok, tmp_path):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = ["Hello there.", "Fine, thanks."]

    def script(input_ids: list[int], index: int) -> list[int]:
        return tok.encode(replies[index], add_special_tokens=False) + [end]

    # the engine holds its stream after the first token until the toy stream has sent an event: text
    # goes out before the end however the chunks would have arrived (in one read, all would be in
    # the end event's `rest`)
    first_sent = threading.Event()
    engine = ScriptedEngine(script, stop_ids={end}, hold_stream=first_sent)

    async def run(url: str) -> tuple[dict[str, Any], list[str], Session]:
        config = GatewayConfig(model="tiny", engine_url=url, spool_dir=str(tmp_path / "spool"))
        client = EngineClient(url)
        svc = build_service(config, tok, 4096, client, SampleSpool(config.spool_dir))
        session = svc.sessions.create("toy", "t", None, {})
        first = await svc.chat(session.session_id, {"turns": [["user", "hi"]]}, TOY)
        turns = [["user", "hi"], ["assistant", first["said"]], ["user", "how are you?"]]
        stream = await svc.chat(session.session_id, {"turns": turns, "stream": True}, TOY)
        events = []
        async for e in stream:
            events.append(e)
            first_sent.set()
        await client.close()
        return first, events, session

    with ThreadServer(engine.app()) as eng:
        first, events, session = asyncio.run(run(eng.url))
    assert first["said"] == "Hello there." and first["why"] == "stop" and first["id"].startswith("toy-")
    assert first["tokens"] == len(tok.encode("Hello there.", add_special_tokens=False)) + 1
    assert events[-1].startswith("event: end\n")
    assert all(e.startswith("event: delta\n") for e in events[:-1])
    streamed = "".join(json.loads(e.split("data: ", 1)[1])["more"] for e in events[:-1])
    assert streamed.startswith("Fine")  # text went out before the end (tiny has no reasoning parser)
    assert streamed + json.loads(events[-1].split("data: ", 1)[1])["rest"] == "Fine, thanks."
    # the toy reply came back as an internal assistant message: the second call bridged, no fork
    t1, t2 = session.turns
    assert t2.parent is t1 and t2.fork_reason is None and t2.call_id.startswith("toy-")
    assert t2.prompt()[: t1.end] == t1.prompt() + t1.output_ids


@pytest.mark.parametrize("ending", ["completed", "incomplete", "failed"])
def test_responses_stream_events_are_json_dumps_of_the_merged_response_byte_for_byte(monkeypatch, ending):
    """The Responses stream dumps the request's echoed fields once (`_EchoJson`) where each of its
    response events dumped them again: the stream's text is the one the plain merge gives, for a
    request whose echo has non-ASCII text, tools and its own `text` format (a field the response
    has too, echoed in its place)."""
    from palaestra.gateway.dialects import responses_answer, responses_api

    request = responses_api.parse(
        {
            "instructions": 'Réponds "vite".\n\t🙂 ' + "x" * 300,
            "input": "q",
            "tools": [
                {"type": "function", "name": "calc", "description": "é", "parameters": {"type": "object"}}
            ],
            "text": {"format": {"type": "json_object"}},
            "metadata": {"k": "ü"},
            "max_output_tokens": 9,
        }
    )
    out = output(text="Bonjour ü", content="Bonjour ü", finish="length" if ending == "incomplete" else "stop")
    done = StreamFailed(GatewayError("engine down", 503, code="engine_unavailable"))
    if ending != "failed":
        done = StreamFinished(TurnResult("resp_x", 1700000000, "tiny", 10, [out]), " ü")

    async def events() -> AsyncGenerator[StreamEvent, None]:
        yield StreamStarted("resp_x", 1700000000, "tiny", 10)
        yield TextDelta("Bonjour", None)
        yield done

    async def text() -> str:
        return "".join([e async for e in responses_answer.stream(request, events())])

    fast = asyncio.run(text())

    def merged(self, kind: str, head: dict[str, Any], echo: Any) -> str:  # the plain merge, dumped whole
        return self(kind, response={**head, **request.echo})

    monkeypatch.setattr(responses_answer._Events, "response", merged)
    assert fast == asyncio.run(text())
    data = [json.loads(line[len("data: ") :]) for line in fast.splitlines() if line.startswith("data: ")]
    kinds = [d["type"] for d in data]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{ending}"
    last = data[-1]["response"]
    assert last["instructions"] == request.echo["instructions"] and last["text"] == {
        "format": {"type": "json_object"}
    }
    assert list(last).index("text") < list(last).index(
        "instructions"
    )  # the response's own field, in its place


def test_responses_echo_tail_is_kept_by_its_json_and_tells_equal_values_apart(monkeypatch):
    """The echoed fields' JSON text is kept by their orjson text across calls (a harness sends the
    same tools every call): the same fields give the very text kept, and values Python calls equal
    but JSON writes differently (1, 1.0, true; key order) each get their own `json.dumps` text."""
    from palaestra.gateway.dialects import responses_answer

    monkeypatch.setattr(responses_answer, "_TAILS", {})
    monkeypatch.setattr(responses_answer, "_TAILS_KEPT", 3)
    tools = [{"type": "function", "name": "é", "parameters": {"type": "object", "x": [1, 2.5]}}]
    first = responses_answer._echo_tail({"tools": tools, "instructions": "ü"})
    again = responses_answer._echo_tail({"tools": json.loads(json.dumps(tools)), "instructions": "ü"})
    assert (
        again is first
        and first == json.dumps({"tools": tools, "instructions": "ü"}, ensure_ascii=False)[1:-1]
    )
    for rest in ({"k": 1}, {"k": 1.0}, {"k": True}, {"a": 1, "b": 2}, {"b": 2, "a": 1}):
        assert responses_answer._echo_tail(rest) == json.dumps(rest, ensure_ascii=False)[1:-1]
    assert len(responses_answer._TAILS) == 3  # the oldest went
    big = {"k": 1 << 70}  # past orjson's integers: written by json.dumps, not kept
    assert responses_answer._echo_tail(big) == f'"k": {1 << 70}' and len(responses_answer._TAILS) == 3
