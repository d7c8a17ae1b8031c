"""Fuzzing the gateway's HTTP surface: never a 5xx, every refusal a 4xx in the dialect's error shape.

* schemathesis over the gateway's own `/openapi.json` (the request-body schemas of
  `gateway/dialects/openapi_schemas.py`), positive and negative examples, a bounded number per run;
* hypothesis strategies for the message / content / tool / tool_choice shapes of each dialect (chat
  completions, completions, Responses, Anthropic Messages), well- and ill-formed: a refusal must be
  a 400 that names the field (OpenAI: `param` is one of the body's fields; Anthropic: the message
  starts with the field's path).

The engine behind the gateway is `ScriptedEngine`, a labelled TEST DOUBLE answering "ok": these
tests are about what the gateway does with its input, not about generation. Run:

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/gateway/test_fuzz.py
"""

from __future__ import annotations

import base64
import json
import os

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from palaestra.gateway.dialects import anthropic_api, controls
from palaestra.gateway.guards import BODY_REASONS
from palaestra.gateway.sessions import sampling as session_sampling
from palaestra.gateway.streaming import safe_prefix
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = {"Authorization": "Bearer k-test"}
EXAMPLES = int(os.environ.get("PALAESTRA_FUZZ_EXAMPLES", "120"))
"""Examples per dialect (hypothesis); set PALAESTRA_FUZZ_EXAMPLES=5000 to fuzz longer by hand."""
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the checkout; a failure prints its seed and example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# Fields each dialect's parser knows: a refusal names one of them (or one the body sent).
KNOWN = {route: set(table) for route, table in controls.TABLES.items()}


@pytest.fixture(scope="module")
def gateway(tok, tmp_path_factory):

    end = tok.convert_tokens_to_ids("<|im_end|>")
    ok = tok.encode("ok", add_special_tokens=False)
    engine = ScriptedEngine(lambda ids, i: ok + [end], stop_ids={end}, context_length=4096)
    with ThreadServer(engine.app()) as eng:
        with (
            gateway_server(eng.url, tmp_path_factory.mktemp("spool"), tok) as gw,
            httpx.Client(base_url=gw.url, headers=KEY, timeout=60) as client,
        ):
            yield gw, gw.app, client


def open_session(client: httpx.Client) -> str:
    r = client.post("/sessions", json={"env": "fuzz", "task_id": "t"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def check_answer(path: str, status: int, answer: bytes, body: object = None) -> None:
    """No 5xx; a 4xx carries its dialect's error envelope; a 400 on a parsed body names the field."""
    text = answer.decode(errors="replace")
    assert status < 500, f"{status} for {path} {body!r:.600}: {text[:600]}"
    if status < 400:
        return
    err = orjson.loads(answer)
    anthropic = path.endswith("/messages") or path.endswith("/messages/count_tokens")
    if anthropic:
        assert err["type"] == "error" and isinstance(err["error"]["message"], str), text
        assert err["error"]["type"] in set(anthropic_api.ERROR_TYPES.values()) | {"api_error"}, text
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}, text
        assert isinstance(err["error"]["message"], str) and err["error"]["type"], text
    if status != 400 or not isinstance(body, dict):
        return
    if path.startswith("/v1/") and "X-Session-ID" in text:
        return  # a header-bound route checks its header before the body, and its 400 names the header
    route = {"chat/completions": "chat"}.get(path.split("/v1/")[-1], path.split("/v1/")[-1])
    fields = KNOWN.get(route, set()) | set(body)
    if anthropic and route == "messages":
        assert err["error"]["message"].split(":")[0].split(".")[0] in fields, text
    elif route in KNOWN and err["error"]["code"] not in BODY_REASONS:
        param = err["error"]["param"] or ""  # a field, or a path into one ('text.format')
        assert param.split(".")[0].split("[")[0] in fields, f"no field named: {text} for {body!r:.600}"


# -- schemathesis over /openapi.json --------------------------------------------------------------
SCHEMATHESIS_EXAMPLES = max(EXAMPLES // 12, 10)
"""Examples per operation and generation mode (positive: bodies the schema allows; negative: ones it
does not). Generating a chat body from its schema takes ~0.25 s here, so this keeps the test well
under a minute."""


def test_schemathesis_whole_http_surface(gateway):
    gw, app, client = gateway
    sid = open_session(client)
    schema = schemathesis.openapi.from_dict(app.openapi())
    seen: dict[int, int] = {}
    fuzzed = []
    for result in schema.get_all_operations():
        op = result.ok()
        # /samples/stream is an endless event stream by design (the trainer's feed): a call never
        # returns, and /samples serves the same records.
        if op.path == "/samples/stream":
            continue
        params = {"session_id": sid} if op.path.startswith("/s/") else None
        for mode in schemathesis.GenerationMode:

            @given(case=op.as_strategy(mode, path_parameters=params, headers=KEY))
            @settings(FUZZ, max_examples=SCHEMATHESIS_EXAMPLES)
            def run(case):
                r = case.call(base_url=gw.url, timeout=60)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                body = case.body if isinstance(case.body, dict) else None
                check_answer(case.path, r.status_code, r.content, body)

            try:
                run()
            except Unsatisfiable:  # nothing invalid to send (e.g. GET /health takes no input)
                assert mode is schemathesis.GenerationMode.NEGATIVE, op.path
                continue
            fuzzed.append(f"{mode.value} {op.method.upper()} {op.path}")
    paths = {p for p in app.openapi()["paths"] if p != "/samples/stream"}
    assert {f.split(" ")[-1] for f in fuzzed if f.startswith("positive")} == paths, fuzzed
    assert seen.get(200, 0) > 30, seen  # positive examples reached the engine, not only refusals
    assert seen.get(400, 0) > 30, seen


# -- hypothesis: each dialect's message, content, tool and tool_choice shapes ---------------------
scalar = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
junk = st.recursive(
    scalar,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
text = st.text(max_size=24)
# JSON text nested past what a recursive parser survives: tool-call arguments arrive as such strings
deep_json = st.integers(min_value=200, max_value=5000).map(lambda d: "[" * d + "]" * d)
name = st.sampled_from(["calc", "search", ""]) | junk
schema_obj = st.just({"type": "object", "properties": {"x": {"type": "string"}}}) | junk


def maybe(strategy):
    return strategy | junk


def text_part(kinds):
    return maybe(
        st.fixed_dictionaries({"type": st.sampled_from(kinds) | junk}, optional={"text": maybe(text)})
    )


openai_content = maybe(text | st.lists(text_part(["text", "input_text", "image_url", "x"]), max_size=3))
chat_tool_call = maybe(
    st.fixed_dictionaries(
        {
            "function": maybe(
                st.fixed_dictionaries({"name": name}, optional={"arguments": maybe(text | deep_json)})
            )
        },
        optional={"id": maybe(text), "type": st.just("function") | junk},
    )
)
chat_message = maybe(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]) | junk},
        optional={
            "content": openai_content,
            "tool_calls": maybe(st.lists(chat_tool_call, max_size=2)),
            "tool_call_id": maybe(text),
            "name": maybe(text),
            "reasoning_content": maybe(text),
        },
    )
)
chat_tool = maybe(
    st.fixed_dictionaries(
        {
            "type": st.just("function") | junk,
            "function": maybe(
                st.fixed_dictionaries(
                    {"name": name}, optional={"parameters": schema_obj, "description": text}
                )
            ),
        }
    )
)
openai_sampling = {
    "max_tokens": maybe(st.integers(min_value=-3, max_value=10**12)),
    "n": maybe(st.integers(min_value=-3, max_value=10**9)),
    "temperature": maybe(st.floats(min_value=-1, max_value=3)),
    "stop": maybe(text | st.lists(text, max_size=20)),
    "logit_bias": junk,
    "seed": junk,
    "stream": maybe(st.booleans()),
}
chat_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(chat_message, min_size=1, max_size=4))},
    optional={
        **openai_sampling,
        "max_completion_tokens": maybe(st.integers(min_value=-3, max_value=10**12)),
        "tools": maybe(st.lists(chat_tool, max_size=2)),
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}
        )
        | junk,
        "response_format": maybe(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])})
        ),
        "logprobs": junk,
        "top_logprobs": junk,
        "chat_template_kwargs": junk,
        "bogus_field": junk,
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": maybe(text | st.lists(text, max_size=2))},
    optional={**openai_sampling, "logprobs": junk, "echo": junk, "suffix": junk},
)
responses_item = maybe(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["message", "reasoning", "function_call", "function_call_output", "x"])
            | junk
        },
        optional={
            "role": st.sampled_from(["user", "assistant", "system", "developer", "x"]) | junk,
            "content": maybe(
                text | st.lists(text_part(["input_text", "output_text", "input_image"]), max_size=2)
            ),
            "name": name,
            "call_id": maybe(text),
            "arguments": maybe(text | deep_json),
            "output": maybe(text),
            "summary": junk,
        },
    )
)
responses_tool = maybe(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]) | junk, "name": name},
        optional={"parameters": schema_obj, "description": text},
    )
)
responses_body = st.fixed_dictionaries(
    {"input": maybe(text | st.lists(responses_item, min_size=1, max_size=4))},
    optional={
        "instructions": maybe(text),
        "max_output_tokens": maybe(st.integers(min_value=-3, max_value=10**12)),
        "tools": maybe(st.lists(responses_tool, max_size=2)),
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.fixed_dictionaries({"type": st.just("function"), "name": name})
        | junk,
        "text": junk | st.fixed_dictionaries({"format": junk}),
        "include": junk,
        "store": junk,
        "previous_response_id": junk,
        "stream": maybe(st.booleans()),
        "reasoning": junk,
        "truncation": junk,
        "top_logprobs": junk,
        "stop": junk,
    },
)
anthropic_block = maybe(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image"]) | junk},
        optional={
            "text": maybe(text),
            "thinking": maybe(text),
            "id": maybe(text),
            "name": name,
            "input": junk,
            "tool_use_id": junk,
            "content": maybe(text | st.lists(text_part(["text", "image"]), max_size=2)),
        },
    )
)
anthropic_message = maybe(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]) | junk,
            "content": maybe(text | st.lists(anthropic_block, max_size=3)),
        }
    )
)
anthropic_body = st.fixed_dictionaries(
    {
        "messages": maybe(st.lists(anthropic_message, min_size=1, max_size=4)),
        "max_tokens": maybe(st.integers(min_value=-3, max_value=10**12)),
    },
    optional={
        "system": maybe(text | st.lists(text_part(["text", "image"]), max_size=2)),
        "tools": maybe(
            st.lists(
                maybe(
                    st.fixed_dictionaries({"name": name, "input_schema": schema_obj}, optional={"type": junk})
                ),
                max_size=2,
            )
        ),
        "tool_choice": maybe(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])}, optional={"name": name}
            )
        ),
        "thinking": junk,
        "stop_sequences": junk,
        "temperature": junk,
        "top_k": junk,
        "stream": maybe(st.booleans()),
    },
)
# Well-formed conversations whose leaves are hostile (deep JSON in arguments, odd text): the mixed
# strategies above rarely get a whole conversation past the parser to where such leaves are read.
leaf = text | deep_json | st.sampled_from(["{}", "null", '{"a": [1, {"b": 2}]}', "\x00", "\ud7ff\ue000"])
tool_turn = st.tuples(st.sampled_from(["calc", "search"]), leaf, leaf)
chat_conversation = st.lists(tool_turn, min_size=1, max_size=3).map(
    lambda turns: {
        "messages": [{"role": "user", "content": "go"}]
        + [
            m
            for i, (fn, args, result) in enumerate(turns)
            for m in (
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": f"c{i}", "type": "function", "function": {"name": fn, "arguments": args}}
                    ],
                },
                {"role": "tool", "tool_call_id": f"c{i}", "content": result},
            )
        ],
        "max_tokens": 2,
    }
)
responses_conversation = st.lists(tool_turn, min_size=1, max_size=3).map(
    lambda turns: {
        "input": [{"role": "user", "content": "go"}]
        + [
            item
            for i, (fn, args, result) in enumerate(turns)
            for item in (
                {"type": "function_call", "call_id": f"c{i}", "name": fn, "arguments": args},
                {"type": "function_call_output", "call_id": f"c{i}", "output": result},
            )
        ],
        "max_output_tokens": 2,
    }
)
DIALECTS = {
    "chat/completions": chat_body | chat_conversation,
    "completions": completion_body,
    "responses": responses_body | responses_conversation,
    "messages": anthropic_body,
}


@pytest.mark.parametrize("route", DIALECTS)
def test_dialect_shapes_never_5xx_and_refusals_name_the_field(gateway, route):
    gw, _, client = gateway
    sid = open_session(client)
    statuses: dict[int, int] = {}

    @given(body=DIALECTS[route])
    @settings(FUZZ)
    def run(body):
        r = client.post(f"/s/{sid}/v1/{route}", json=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_answer(f"/s/{sid}/v1/{route}", r.status_code, r.content, body)

    run()
    assert statuses.get(400, 0) > 10, statuses


# -- one hostile value in an otherwise well-formed harness request -----------------------------------
# The mixed strategies above seldom get a body past its first refusal, so a shape read late (a tool's
# type, a thinking block, a custom tool call) is rarely reached. Here every request is one the
# harnesses send (Codex's Responses call, Claude Code's Messages call, an OpenAI SDK agent's chat
# call: namespace, custom and hosted tools, `include`, `reasoning`, `context_management`,
# `output_config`, system messages inside `messages`, thinking blocks), with exactly one value, at
# any depth, replaced by a wrong type or an extreme value (or its key dropped).
_PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
HARNESS_BODIES = {
    "responses": {
        "model": "gpt-5-codex",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "look"}],
                "content": [{"type": "reasoning_text", "text": "think"}],
                "encrypted_content": None,
            },
            {"type": "function_call", "name": "shell", "arguments": '{"cmd": "ls"}', "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch", "call_id": "c2"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
            {
                "type": "function_call",
                "namespace": "mcp",
                "name": "fetch",
                "arguments": "{}",
                "call_id": "c3",
            },
            {
                "type": "function_call_output",
                "call_id": "c3",
                "output": [{"type": "input_text", "text": "x"}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "run",
                "strict": False,
                "parameters": _PARAMS,
            },
            {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "text"}},
            {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "fetch"}]},
            {"type": "web_search", "search_context_size": "low"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "top_logprobs": 2,
        "prompt_cache_key": "k",
        "text": {"verbosity": "low"},
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "client_metadata": {"x-codex-turn": "1"},
        "max_output_tokens": 2,
        "stream": True,
    },
    "messages": {
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look", "signature": "sig"},
                    {"type": "text", "text": "running"},
                    {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "a.py"}],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
            {"role": "system", "content": "<system-reminder>todo list is empty</system-reminder>"},
            {"role": "user", "content": "and?"},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "run",
                "input_schema": _PARAMS,
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "bash_20250124", "name": "bash"},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "metadata": {"user_id": "u"},
        "temperature": 1,
        "max_tokens": 2,
        "stream": True,
    },
    "chat/completions": {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "look",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "shell", "description": "run", "parameters": _PARAMS}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "shell"}},
        "reasoning_effort": "low",
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 7,
        "stop": ["\n\n\n"],
        "max_completion_tokens": 2,
        "stream": True,
    },
}
STREAM_ENDS = {
    "responses": "event: response.",
    "messages": "event: message_stop",
    "chat/completions": "[DONE]",
}
"""How each dialect's event stream ends when the stream ran to its end."""
_DROP = object()  # the hostile "value" that removes the key
hostile = (
    junk
    | st.sampled_from([{}, [], ["function"], {"type": {}}, {"type": {"type": "bogus"}}, _DROP])
    | st.sampled_from([1e308, -1e308, 2**64 - 1, -(2**63), 2**63, 0, -1, 0.5, "", "\x00" * 3])
)


def _paths(value: object, at: tuple = ()) -> list[tuple]:
    """Every key and index inside `value`, as paths from the top."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for k, v in items for p in [(*at, k), *_paths(v, (*at, k))]]


def _replaced(body: dict, path: tuple, value: object) -> dict:
    body = json.loads(json.dumps(body))
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    if value is _DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return body


def harness_call(route: str, stream: bool) -> st.SearchStrategy:
    base = {**HARNESS_BODIES[route], "stream": stream}
    return st.tuples(st.sampled_from(_paths(base)), hostile).map(lambda pv: _replaced(base, *pv))


def _post(client: httpx.Client, sid: str, route: str, body: dict) -> None:
    path = f"/s/{sid}/v1/{route}"
    r = client.post(path, json=body)
    check_answer(path, r.status_code, r.content, body)
    if r.status_code == 200 and body.get("stream") is True:
        assert STREAM_ENDS[route] in r.text.rstrip().rsplit("\n\n", 1)[-1], (
            f"stream cut short for {body!r:.600}: {r.text[-600:]}"
        )


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize("route", HARNESS_BODIES)
def test_one_hostile_value_in_a_harness_request_is_a_4xx_naming_its_field(gateway, route, stream):
    gw, _, client = gateway
    sid = open_session(client)
    r = client.post(f"/s/{sid}/v1/{route}", json={**HARNESS_BODIES[route], "stream": stream})
    assert r.status_code == 200, r.text  # the unharmed request is served: the values below reach deep

    @given(body=harness_call(route, stream))
    @settings(FUZZ, max_examples=max(EXAMPLES // 2, 10))
    def run(body):
        _post(client, sid, route, body)

    run()


# The shapes that answered 500 once (issue 37), each on both the streamed and the unstreamed call.
_R, _M, _C = HARNESS_BODIES["responses"], HARNESS_BODIES["messages"], HARNESS_BODIES["chat/completions"]
REGRESSIONS = [
    ("responses", ("tools", 0, "type"), {}, "tools"),
    ("responses", ("tools", 0, "type"), ["function"], "tools"),
    ("responses", ("tools", 0, "type"), {"type": "bogus"}, "tools"),
    ("responses", ("tools", 3, "type"), ["web_search"], "tools"),
    ("responses", ("max_output_tokens",), 1e308, "max_output_tokens"),
    ("responses", ("tool_choice",), {"type": "function", "name": ["shell"]}, "tool_choice"),
    ("responses", ("tools", 0, "description"), {"text": "run"}, "tools"),
    ("responses", ("tools", 1, "format"), ["text"], "tools"),
    ("responses", ("input", 2, "encrypted_content"), {}, "input"),
    ("responses", ("input", 5, "input"), {"patch": 1}, "input"),
    ("messages", ("tools", 1, "type"), ["bash_20250124"], "tools"),
    ("messages", ("tools", 0, "description"), {}, "tools"),
    ("messages", ("tool_choice",), {"type": "tool", "name": ["Bash"]}, "tool_choice"),
    ("messages", ("max_tokens",), 1e308, "max_tokens"),
    ("messages", ("thinking", "budget_tokens"), 1e308, "thinking"),
    ("messages", ("messages", 1, "content", 0, "thinking"), {"a": 1}, "messages"),
    ("messages", ("messages", 1, "content", 0, "signature"), [], "messages"),
    ("messages", ("messages", 1, "content", 1, "text"), ["running"], "messages"),
    ("messages", ("messages", 2, "content", 0, "tool_use_id"), {}, "messages"),
    ("messages", ("messages", 3, "content"), [{"type": "text", "text": {}}], "messages"),
    ("messages", ("system", 0, "text"), 5, "system"),
    ("chat/completions", ("max_completion_tokens",), 1e308, "max_completion_tokens"),
    ("chat/completions", ("tool_choice", "function"), ["shell"], "tool_choice"),
    ("chat/completions", ("tool_choice", "function", "name"), {}, "tool_choice"),
    ("chat/completions", ("tools", 0, "function", "description"), 7, "tools"),
    ("chat/completions", ("messages", 1, "content", 0, "text"), None, "messages"),
    ("chat/completions", ("messages", 0), {"content": "x", "name": "n"}, "messages"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize(("route", "path", "value", "field"), REGRESSIONS, ids=lambda v: str(v)[:40])
def test_wrong_types_and_extremes_found_once_are_a_400_naming_the_field(
    gateway, route, path, value, field, stream
):
    gw, _, client = gateway
    sid = open_session(client)
    body = _replaced({**HARNESS_BODIES[route], "stream": stream}, path, value)
    r = client.post(f"/s/{sid}/v1/{route}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    named = err["message"].split(":")[0].split(".")[0] if route == "messages" else err["param"]
    assert named == field, err


# -- the per-token stop-string check: fast, and the same answer as the plain definition ----------
def _safe_prefix_by_definition(text: str, markers: list[str], stops: list[str]) -> str:
    """What `streaming.safe_prefix` answers, written the obvious way (quadratic in the stop length)."""
    cut = len(text)
    while cut and text[cut - 1] == "\ufffd":
        cut -= 1
    for s in markers + stops:
        pos = text.find(s)
        if pos >= 0:
            cut = min(cut, pos)
        for k in range(len(s) - 1, 0, -1):
            if text[:cut].endswith(s[:k]):
                cut -= k
                break
    return text[:cut]


small = st.text(alphabet="ab<\ufffd", max_size=12)


@given(small, st.lists(small.filter(bool), max_size=3), st.lists(small.filter(bool), max_size=3))
@settings(FUZZ, max_examples=EXAMPLES * 20)
def test_safe_prefix_matches_its_definition(text, markers, stops):
    assert safe_prefix(text, markers, stops) == _safe_prefix_by_definition(text, markers, stops)


# -- routing replay: the gateway option and the engine's routed_experts field -------------------------
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.integers(min_value=-(2**70), max_value=2**70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@given(value=_JSON)
@settings(FUZZ)
def test_return_routed_experts_option_takes_a_boolean_only(value):
    from palaestra.config import load_config
    from palaestra.typed_config import ConfigError

    override = f"gateway.return_routed_experts={json.dumps(value)}"  # YAML reads JSON
    try:
        cfg = load_config(None, [override])
    except ConfigError as exc:
        assert "return_routed_experts" in str(exc), exc
        assert not isinstance(value, bool)
        return
    assert isinstance(value, bool) and cfg.gateway.return_routed_experts is value


@given(
    data=_JSON | st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
    start=st.integers(min_value=0, max_value=2**40),
)
@settings(FUZZ, max_examples=EXAMPLES * 5)
def test_the_engines_routed_experts_field_is_read_or_a_502_naming_it(data, start):
    """Whatever an engine puts in meta_info.routed_experts: rows of layers x top_k non-negative ids
    from `start`, or a 502 (the flag named when the field is missing); never another exception."""
    from palaestra.gateway.engine_side.engine_client import RoutingAsk
    from palaestra.gateway.errors import GatewayError

    ask = RoutingAsk(start, 2, 2)
    meta = {} if data is None else {"routed_experts": data}
    try:
        routed = ask.read(meta)
    except GatewayError as exc:
        assert exc.status == 502, exc
        assert "routed_experts" in exc.message
        if data is None:
            assert "--enable-return-routed-experts" in exc.message
        return
    assert routed.start == start and routed.experts.ndim == 3 and routed.experts.shape[1:] == (2, 2)
    assert routed.end == start + len(routed.experts)


# -- a session's sampling (POST /sessions' `sampling`, gateway/sessions/sampling.py) --------------
def _encodable(value: object) -> bool:
    """JSON the gateway can read at all: finite numbers, integers within 64 bits."""
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**64
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    if isinstance(value, dict):
        return all(_encodable(v) for v in value.values())
    return True


@given(
    key=st.sampled_from(sorted(session_sampling.FIELDS)) | st.text(max_size=6),
    value=(_JSON | st.floats(-3, 3) | st.integers(-(2**63), 2**63 - 1)).filter(_encodable),
)
@settings(FUZZ, max_examples=EXAMPLES * 2)
def test_session_sampling_is_taken_in_range_or_refused_naming_the_field(gateway, key, value):
    _, _, client = gateway
    r = client.post("/sessions", json={"env": "fuzz", "sampling": {key: value}})
    check_answer("/sessions", r.status_code, r.content)
    spec = session_sampling.FIELDS.get(key)
    number = spec is not None and (isinstance(value, int) if spec[3] else isinstance(value, (int, float)))
    valid = number and not isinstance(value, bool) and spec[1] <= value <= spec[2]
    if valid:
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        assert client.get(f"/sessions/{sid}").json()["sampling"] == {key: value}
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"sampling.{key}", r.text
