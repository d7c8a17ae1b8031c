"""The per-session reuse of a parsed history (gateway/sessions/history.py) and of its digests
(renderer.HistoryDigests): a call that repeats the previous call's history must come out exactly as
if parsed and digested from scratch, errors included.

    .venv/bin/python -m pytest -q tests/gateway/test_history.py
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from palaestra.gateway.dialects import anthropic_api, openai_request, responses_api
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.renderer import HistoryDigests, chain_digests
from palaestra.gateway.sessions.history import ParseMemo


def _fresh(body: dict[str, Any]) -> dict[str, Any]:
    """What the route hands the parser: new objects parsed from JSON, as every call gets."""
    return orjson.loads(orjson.dumps(body))


def _assistant_call(args: str) -> dict[str, Any]:
    fn = {"name": "f", "arguments": args}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": fn}],
    }


CASES = {
    "chat": (
        openai_request.parse_chat,
        lambda history: {"model": "m", "messages": [{"role": "system", "content": "S"}, *history]},
        [
            {"role": "user", "content": "hi"},
            _assistant_call('{"x": 1}'),
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}]},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "more"},
        ],
    ),
    "responses": (
        responses_api.parse,
        lambda history: {"model": "m", "instructions": "S", "input": history},
        [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c", "output": "r"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": "more"},
        ],
    ),
    "messages": (
        anthropic_api.parse,
        lambda history: {"model": "m", "system": "S", "messages": history, "max_tokens": 8},
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"x": 1}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "more"},
        ],
    ),
}


@pytest.mark.parametrize("dialect", list(CASES))
def test_a_growing_history_parses_as_from_scratch(dialect):
    parse, body_of, history = CASES[dialect]
    memo = ParseMemo()
    for end in range(1, len(history) + 1):
        body = body_of(history[:end])
        assert parse(_fresh(body), memo).messages == parse(_fresh(body)).messages


@pytest.mark.parametrize("dialect", list(CASES))
def test_a_bad_new_item_is_refused_as_without_the_memo(dialect):
    parse, body_of, history = CASES[dialect]
    memo = ParseMemo()
    parse(_fresh(body_of(history)), memo)
    bad = body_of([*history, {"role": "wizard", "content": "x"}])
    with pytest.raises(GatewayError) as plain:
        parse(_fresh(bad))
    with pytest.raises(GatewayError) as memoised:
        parse(_fresh(bad), memo)
    assert memoised.value.message == plain.value.message


def test_numbers_equal_in_python_but_printed_differently_are_not_reused():
    """1 == 1.0 in Python; the template prints the arguments the agent sent, so 1.0 must stay 1.0."""
    memo = ParseMemo()
    first = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"x": 1}}],
    }
    history = [{"role": "user", "content": "hi"}, first, {"role": "user", "content": "go"}]
    body = {"model": "m", "messages": history, "max_tokens": 8}
    anthropic_api.parse(_fresh(body), memo)
    edited = copy.deepcopy(body)
    edited["messages"][1]["content"][0]["input"] = {"x": 1.0}
    args = anthropic_api.parse(_fresh(edited), memo).messages[1]["tool_calls"][0]["function"]["arguments"]
    assert repr(args) == "{'x': 1.0}"


def test_history_digests_match_chain_digests_and_see_exact_arguments():
    digests = HistoryDigests()
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    turn = [
        *base,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "v"},
    ]
    assert digests.of(copy.deepcopy(base)) == chain_digests(base)
    assert digests.of(copy.deepcopy(turn)) == chain_digests(turn)
    longer = [*turn, {"role": "assistant", "content": "w"}, {"role": "user", "content": "z"}]
    assert digests.of(copy.deepcopy(longer)) == chain_digests(longer)
    edited = copy.deepcopy(longer)
    edited[2]["tool_calls"][0]["function"]["arguments"] = {"x": 1.0}  # == the old one, prints differently
    assert digests.of(copy.deepcopy(edited)) == chain_digests(edited) != chain_digests(longer)
    assert digests.of(copy.deepcopy(base)) == chain_digests(base)  # a shorter history: from scratch


@pytest.mark.parametrize("dialect", list(CASES))
def test_the_repeated_history_is_reused_not_converted_again(dialect):
    parse, body_of, history = CASES[dialect]
    memo = ParseMemo()
    before = parse(_fresh(body_of(history[:-2])), memo).messages  # ends closed: a tool result
    after = parse(_fresh(body_of(history)), memo).messages
    assert all(a is b for a, b in zip(before[1:], after[1 : len(before)], strict=True))


# -- the tools: converted once while the same ones come back -----------------------------------------
_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 1}}}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": _SCHEMA}}],
    "responses": [
        {"type": "function", "name": "f", "description": "d", "parameters": _SCHEMA, "strict": True},
        {"type": "web_search"},  # hosted: recorded
    ],
    "messages": [
        {"name": "f", "description": "d", "input_schema": _SCHEMA, "defer_loading": True},  # recorded
        {"type": "web_search_20250305", "name": "web_search"},  # a server tool: recorded
    ],
}


def _request(dialect: str, tools: list[dict[str, Any]], memo: ParseMemo | None) -> Any:
    parse, body_of, history = CASES[dialect]
    return parse(_fresh({**body_of(history), "tools": tools}), memo)


@pytest.mark.parametrize("dialect", list(CASES))
def test_the_same_tools_again_are_not_converted_again_and_come_out_as_from_scratch(dialect):
    memo = ParseMemo()
    first = _request(dialect, TOOLS[dialect], memo)
    again = _request(dialect, TOOLS[dialect], memo)
    plain = _request(dialect, TOOLS[dialect], None)
    assert again.tools is first.tools  # the memo's: not converted again
    for request in (first, again):
        assert request.tools == plain.tools
        assert request.ignored == plain.ignored  # what converting them recorded, recorded again
        assert request.shaping == plain.shaping  # Responses: each rendered name's tool
    assert bool(plain.ignored) is (dialect != "chat")  # (chat's tools record nothing)
    if dialect == "responses":  # the answer's own map of names, not the memo's
        assert again.shaping["tools"] is not first.shaping["tools"]


@pytest.mark.parametrize("dialect", list(CASES))
def test_tools_that_differ_in_a_byte_are_converted_again(dialect):
    memo = ParseMemo()
    first = _request(dialect, TOOLS[dialect], memo)
    edited = copy.deepcopy(TOOLS[dialect])
    schema = edited[0].get("function", edited[0]).get("parameters") or edited[0]["input_schema"]
    schema["properties"]["x"]["minimum"] = 1.0  # == 1 in Python; the template prints 1.0
    again = _request(dialect, edited, memo)
    assert again.tools is not first.tools and again.tools == _request(dialect, edited, None).tools
    assert b"1.0" in orjson.dumps(again.tools)


@pytest.mark.parametrize("dialect", list(CASES))
def test_bad_tools_are_refused_as_without_the_memo_and_not_kept(dialect):
    memo = ParseMemo()
    _request(dialect, TOOLS[dialect], memo)
    bad = [{"type": "function"}] if dialect != "messages" else [{"description": "no name"}]
    with pytest.raises(GatewayError) as plain:
        _request(dialect, bad, None)
    for _ in range(2):
        with pytest.raises(GatewayError) as memoised:
            _request(dialect, bad, memo)
        assert memoised.value.message == plain.value.message


def test_the_context_is_the_tools_and_template_arguments_json_with_sorted_keys():
    memo = ParseMemo()
    tools = _request("messages", TOOLS["messages"], memo).tools
    for kwargs in (None, {"enable_thinking": False, "a": [1, 2.0]}):
        expected = orjson.dumps([tools, kwargs], option=orjson.OPT_SORT_KEYS)
        assert memo.context(tools, kwargs) == expected
        assert memo.context(tools, kwargs) == expected  # the tools' JSON kept
    assert memo.context(None, None) == b"[null,null]"
