"""The tool loop every tool environment runs (`environments/episode.py`'s `ToolLoop`), through the
real gateway: the math-tool environment's malformed calls are answered with the error and counted,
and a conversation that outgrows the context ends the episode, graded as it stands. The model is a
SCRIPTED ENGINE (a labelled TEST DOUBLE from tests/support/servers.py that answers /generate with
the token ids of texts the test chose); the gateway, its tool-call parser and the openai client
are real."""

from __future__ import annotations

import json

import pytest

from palaestra.environments.episode import ToolCallError, ToolLoop, check_arguments
from palaestra.environments.math.calculator import CALCULATOR_TOOL
from palaestra.environments.math.env import MathToolEnv
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.sdk.runner import take_tasks
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import rollouts


def calc(expression):
    return render_tool_call_text("hermes", "calculator", json.dumps({"expression": expression}))


def play(tok, tmp_path, env, task, replies, context_length=None):
    """One episode of `env` on `task` whose model says `replies` in turn; (result, engine)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        lambda ids, i: tok.encode(replies[min(i, len(replies) - 1)], add_special_tokens=False) + [end],
        stop_ids={end},
    )
    with ThreadServer(engine.app()) as eng:
        spool = tmp_path / f"spool-{context_length}"
        with gateway_server(eng.url, spool, tok, api_key="k", context_length=context_length) as gw:
            result = rollouts(gw.url, "k", env, [task]).results[0]
    assert result.status == "completed", result.error
    return result, engine


def test_math_tool_answers_malformed_calls_with_the_error_and_counts_them(tok, tmp_path):
    env = MathToolEnv(difficulty=1, max_turns=5)
    task = take_tasks(env, 1, seed=7)[0]
    replies = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',  # not JSON
        render_tool_call_text("hermes", "calculator", json.dumps({"expr": "2 + 2"})),  # wrong argument
        render_tool_call_text("hermes", "abacus", json.dumps({"expression": "2 + 2"})),  # no such tool
        calc("2 + 2"),
        f"The answer is \\boxed{{{task.answer}}}.",
    ]
    result, engine = play(tok, tmp_path, env, task, replies)
    assert result.reward == 1.0 and result.metrics["correct"] == 1.0
    assert result.metrics["failure/tool_call_parse"] == 3.0 and result.metrics["tool_calls"] == 3.0
    assert result.metrics["failure/context_exceeded"] == 0.0 and result.metrics["failure/no_answer"] == 0.0
    assert result.metrics["time/model_s"] > 0
    last_prompt = tok.decode(engine.exchanges[-1].body["input_ids"])
    assert "error: that tool call could not be parsed" in last_prompt  # said as the user (no call id)
    assert "error: missing string argument 'expression'" in last_prompt
    assert "error: unknown tool 'abacus'; the tool is calculator" in last_prompt
    assert "<tool_response>\n4\n</tool_response>" in last_prompt


def test_math_tool_grades_the_episode_as_it_stands_when_the_context_is_exceeded(tok, tmp_path):
    env = MathToolEnv(difficulty=1, max_turns=4, max_tokens=16)
    task = take_tasks(env, 1, seed=7)[0]
    # The first reply already holds the answer, then calls the calculator; the tool round makes the
    # next prompt too long for a context that only just fits the first call.
    first = f"So \\boxed{{{task.answer}}}." + calc("1 + 1")
    roomy, engine = play(tok, tmp_path, env, task, [first, "done"])
    first_prompt = len(engine.exchanges[0].body["input_ids"])
    assert roomy.metrics["failure/context_exceeded"] == 0.0 and len(engine.exchanges) == 2

    tight, engine = play(tok, tmp_path, env, task, [first, "done"], context_length=first_prompt + 16)
    assert len(engine.exchanges) == 1  # the second call never reached the engine
    assert tight.metrics["failure/context_exceeded"] == 1.0 and tight.metrics["failure/no_answer"] == 1.0
    assert tight.reward == 1.0 and tight.metrics["correct"] == 1.0  # the reply it had, graded


def test_arguments_are_checked_against_the_tool_schema():
    assert check_arguments(CALCULATOR_TOOL, '{"expression": "1"}') == {"expression": "1"}
    for arguments, error in (
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"expression": 5}', "missing string argument 'expression'"),
        ("{}", "missing string argument 'expression'"),
        ("", "missing string argument 'expression'"),
    ):
        with pytest.raises(ToolCallError, match=error):
            check_arguments(CALCULATOR_TOOL, arguments)
    counted = {
        "type": "function",
        "function": {
            "name": "repeat",
            "parameters": {
                "type": "object",
                "properties": {"times": {"type": "integer"}, "loud": {"type": "boolean"}},
                "required": ["times", "loud"],
            },
        },
    }
    assert check_arguments(counted, '{"times": 3, "loud": false}') == {"times": 3, "loud": False}
    with pytest.raises(ToolCallError, match="missing integer argument 'times'"):
        check_arguments(counted, '{"times": true, "loud": false}')  # a boolean is not an integer
    no_arguments = {"type": "function", "function": {"name": "submit", "parameters": {"properties": {}}}}
    assert check_arguments(no_arguments, "not even JSON") == {}  # takes none: whatever came is ignored


def test_a_loop_needs_turns_and_tools():
    with pytest.raises(ValueError, match="max_turns must be at least 1; got 0"):
        ToolLoop([CALCULATOR_TOOL], max_turns=0, max_tokens=8)
    with pytest.raises(ValueError, match="at least one tool"):
        ToolLoop([], max_turns=1, max_tokens=8)
