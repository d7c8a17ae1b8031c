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
