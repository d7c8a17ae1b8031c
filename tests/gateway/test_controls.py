"""Every public-API field honoured, recorded or refused (gateway/dialects/controls.py), with the request shapes
Claude Code 2.1.328 and Codex 0.169.0 send, and a stream that ends with an error event when the
engine does not answer in SGLang's event stream.

The bodies below have the fields, nesting and values those harnesses send (read off their
requests to a recording server), with our own short texts in place of their prompts. The engine is
`ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py); the gateway, the Qwen2.5
template of the `tiny` preset and the tokenizer are real. The binaries themselves drive a session
in tests/environments/test_harness_binaries.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from palaestra.gateway.dialect import Reasoning, TurnRequest
from palaestra.gateway.dialects import anthropic_api, controls, responses_api
from palaestra.gateway.dialects.sealed import seal, unseal
from palaestra.gateway.dialects.template_caps import TemplateCaps, probe
from palaestra.gateway.dialects.validate import MAX_NEW_TOKENS
from palaestra.gateway.parsers import render_tool_call_text
from tests.support.servers import ThreadServer, gateway_server
from tests.support.sessions import AUTH, new_session, trajectory

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"

BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "mid-conversation-tool-changes-2026-07-01,advanced-tool-use-2025-11-20,effort-2025-11-24"
)
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}


def claude_code_body() -> dict:
    """A first turn as Claude Code 2.1.328 sends it (`POST /v1/messages?beta=true`)."""
    return {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>a reminder</system-reminder>"},
                    {"type": "text", "text": "list the files"},
                ],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": "# Environment MID-SYSTEM",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "system": [
            {"type": "text", "text": "x-billing-header: cc_version=test"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [BASH, {**BASH, "name": "Deferred", "defer_loading": True}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}


def codex_body() -> dict:
    """A first turn as Codex 0.169.0 sends it (`POST /v1/responses`, `wire_api = "responses"`)."""
    return {
        "model": "tiny",
        "instructions": None,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<cwd>/w</cwd>"}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "close the agent"}],
            },
        ],
        "tools": [
            EXEC,
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Agents.",
                "tools": [{**EXEC, "name": "close_agent", "description": "Close one."}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2-thread",
        "client_metadata": {"x-codex-window-id": "01a2:0"},
    }


def events(text: str) -> list[tuple[str, dict]]:
    out, kind = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and line[6:] != "[DONE]":
            data = json.loads(line[6:])
            out.append((kind or data.get("type"), data))
    return out


# -- the tables ------------------------------------------------------------------------------------
def test_docs_print_the_tables():
    docs = DOCS.read_text()
    for route in controls.TABLES:
        start, end = f"<!-- controls:{route} -->\n", f"\n<!-- /controls:{route} -->"
        assert start in docs and end in docs, f"docs/gateway.md lacks the {route} table"
        printed = docs[docs.index(start) + len(start) : docs.index(end)]
        assert printed == controls.markdown(route), f"docs/gateway.md's {route} table is stale"


def test_every_field_the_pinned_sdks_declare_is_in_a_table():
    from anthropic.types import message_create_params as messages
    from anthropic.types.beta import message_create_params as beta_messages
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    for route, params in (
        ("chat", chat.CompletionCreateParamsBase),
        ("completions", completions.CompletionCreateParamsBase),
        ("responses", responses.ResponseCreateParamsBase),
        ("messages", messages.MessageCreateParamsBase),
        ("messages", beta_messages.MessageCreateParamsBase),
    ):
        missing = sorted(set(params.__annotations__) - set(controls.TABLES[route]))
        assert missing == [], f"{route}: {missing} are public fields in no table"


def test_screen_records_refuses_and_keeps_unknown_fields_strict():
    unknown = lambda k: ValueError(f"unknown {k}")  # noqa: E731
    refuse = lambda k, why: ValueError(f"refused {k}")  # noqa: E731
    rec = controls.screen(
        {"input": "x", "client_metadata": {}, "background": False, "parallel_tool_calls": True},
        controls.RESPONSES,
        unknown,
        refuse,
    )
    assert rec.notes == ["client_metadata"]  # background false and parallel true ask for nothing
    with pytest.raises(ValueError, match="refused background"):
        controls.screen({"background": True}, controls.RESPONSES, unknown, refuse)
    with pytest.raises(ValueError, match="unknown no_such_field"):
        controls.screen({"no_such_field": 1}, controls.RESPONSES, unknown, refuse)
    many = controls.Recorder(f"flag{i}" for i in range(200))
    assert len(many.notes) == controls.MAX_NOTES


def test_resolve_maps_reasoning_onto_the_templates_switch():
    def req(effort, on=True):
        msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        return TurnRequest(msgs, None, "none", None, reasoning=Reasoning(on, effort, "output_config.effort"))

    r = req("high")
    controls.resolve(r, TemplateCaps("enable_thinking", "as_is"))
    assert r.template_kwargs == {"enable_thinking": True} and r.ignored == []
    assert r.messages[1]["role"] == "system"
    r = req("medium")
    controls.resolve(r, TemplateCaps("reasoning_effort", "as_user"))
    assert r.template_kwargs == {"reasoning_effort": "medium"}
    assert r.messages[1] == {"role": "user", "content": "b"} and r.ignored == ["mid_system=as_user"]
    r = req("high")
    controls.resolve(r, TemplateCaps(None, "as_is"))
    assert r.template_kwargs is None and r.ignored == ["output_config.effort"]
    r = req(None, on=False)
    r.template_kwargs = {"enable_thinking": True}  # an explicit chat_template_kwargs wins
    controls.resolve(r, TemplateCaps("enable_thinking", "as_is"))
    assert r.template_kwargs == {"enable_thinking": True}


def test_probe_reads_the_tiny_templates_caps(stack):
    gw, _, _ = stack
    caps = probe(gw.app.state.service.renderer)
    assert caps == TemplateCaps(None, "as_is")  # Qwen2.5: no thinking switch, system messages anywhere


def test_sealed_reasoning_round_trips_and_refuses_foreign_strings():
    text = "I should list the files first. " * 50
    assert unseal(seal(text)) == text
    for foreign in (None, "", "EqQBCkgIARABGAIiQNVo", "palaestra-r1:not base64!", 7):
        assert unseal(foreign) is None
    # what a client sends back with only the sealed string: the reasoning as the model wrote it
    item = {"type": "reasoning", "summary": [], "encrypted_content": seal("think A")}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    request = responses_api.parse({"input": [{"role": "user", "content": "q"}, item, call], "include": []})
    assert request.messages[1]["reasoning_content"] == "think A"
    block = {"type": "thinking", "thinking": "", "signature": seal("think B")}
    body = {
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [block]}],
    }
    assert anthropic_api.parse(body).messages[1]["reasoning_content"] == "think B"


# -- the harnesses' request shapes through the gateway ------------------------------------------------
@pytest.fixture
def small_context(stack, tok, tmp_path):
    """The scripted engine behind a gateway told the context is 16k tokens (Claude Code asks 32k)."""
    _, engine, script = stack
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "small", tok, context_length=16384) as gw:
            yield gw, engine, script


def test_claude_code_first_turn_is_served_and_its_controls_recorded(small_context):
    gw, engine, script = small_context
    s = new_session(gw)
    script.queue.append("Listing.\n" + render_tool_call_text("hermes", "Bash", '{"command": "ls"}'))
    url = f"{s['base_url']}/messages?beta=true"
    headers = {"x-api-key": s["api_key"], "anthropic-beta": BETAS, "anthropic-version": "2023-06-01"}
    r = httpx.post(url, json=claude_code_body(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    evs = events(r.text)
    assert evs[0][0] == "message_start" and evs[-1][0] == "message_stop", evs
    tool = [d["content_block"] for k, d in evs if k == "content_block_start"][-1]
    assert tool["type"] == "tool_use" and tool["name"] == "Bash"
    prompt = script.tok.decode(engine.exchanges[-1].body["input_ids"])
    assert "<|im_start|>system\n# Environment MID-SYSTEM<|im_end|>" in prompt  # where it was sent
    traj = trajectory(gw, s["session_id"])
    (turn,) = traj["turns"]
    room = 16384 - len(engine.exchanges[-1].body["input_ids"])
    assert turn["controls"]["max_tokens"] == {"field": "max_tokens", "asked": 32000, "granted": room}
    assert engine.exchanges[-1].body["sampling_params"]["max_new_tokens"] == room
    for name in ("metadata", "context_management", "tools.defer_loading", "output_config.effort"):
        assert traj["ignored_controls"].get(name) == 1, traj["ignored_controls"]
    for flag in BETAS.split(","):
        assert traj["ignored_controls"].get(f"anthropic-beta={flag}") == 1
    metrics = httpx.get(f"{gw.url}/metrics", headers=AUTH).text
    assert (
        'palaestra_gateway_ignored_controls_total{control="context_management",route="messages"} 1.0'
        in metrics
    )
    assert 'palaestra_gateway_max_tokens_clamped_total{route="messages"} 1.0' in metrics


def test_the_largest_max_tokens_is_clamped_and_recorded_and_one_past_it_is_a_400(small_context):
    """Found by the schemathesis fuzz: 2**64 was clamped, then the journal could not write it (500);
    then 1e308 (an integer of 1024 bits) broke the Responses echo (500, issue 37). A budget is at
    most `MAX_NEW_TOKENS`: that one is clamped to the context, one more is a 400 naming the field."""
    gw, engine, script = small_context
    s = new_session(gw)
    script.queue.append("ok")
    body = {"model": "m", "max_tokens": MAX_NEW_TOKENS, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{s['base_url']}/messages", json=body, headers={"x-api-key": s["api_key"]}, timeout=60)
    assert r.status_code == 200, r.text
    (turn,) = trajectory(gw, s["session_id"])["turns"]
    room = 16384 - len(engine.exchanges[-1].body["input_ids"])
    assert turn["controls"]["max_tokens"] == {"field": "max_tokens", "asked": MAX_NEW_TOKENS, "granted": room}
    for huge in (MAX_NEW_TOKENS + 1, 1 << 64, 1e308):
        body["max_tokens"] = huge
        r = httpx.post(
            f"{s['base_url']}/messages", json=body, headers={"x-api-key": s["api_key"]}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: "), r.text
        assert str(MAX_NEW_TOKENS) in r.json()["error"]["message"]


def test_codex_first_turn_maps_namespace_tools_and_seals_reasoning(stack):
    gw, engine, script = stack
    s = new_session(gw)
    call = render_tool_call_text("hermes", "multi_agent_v1.close_agent", '{"cmd": "x"}')
    script.queue.append("<think>close it</think>" + call)
    url = f"{s['base_url']}/responses"
    r = httpx.post(url, json=codex_body(), headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=60)
    assert r.status_code == 200, r.text
    evs = events(r.text)
    assert evs[-1][0] == "response.completed", evs[-1]
    items = evs[-1][1]["response"]["output"]
    fc = next(i for i in items if i["type"] == "function_call")
    assert (fc["name"], fc["namespace"]) == ("close_agent", "multi_agent_v1")
    prompt = script.tok.decode(engine.exchanges[-1].body["input_ids"])
    assert '"name": "multi_agent_v1.close_agent"' in prompt and "web_search" not in prompt
    traj = trajectory(gw, s["session_id"])
    for name in ("client_metadata", "prompt_cache_key", "reasoning.summary", "tools=web_search"):
        assert traj["ignored_controls"].get(name) == 1, traj["ignored_controls"]
    # Qwen2.5 has no reasoning parser: the think text stays in the message (sealing: test below)
    assert [i["type"] for i in items] == ["message", "function_call"]
    # the next turn, as Codex sends it with store false: every output item back, without ids
    sent_back = [{k: v for k, v in i.items() if k not in ("id", "status")} for i in items]
    nxt = codex_body()
    nxt["input"] += sent_back + [
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "closed"}
    ]
    script.queue.append("Done.")
    r = httpx.post(url, json=nxt, headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=60)
    assert r.status_code == 200, r.text
    first, second = engine.exchanges[-2], engine.exchanges[-1]
    head = first.body["input_ids"] + first.answer["output_ids"]
    assert second.body["input_ids"][: len(head)] == head
    assert trajectory(gw, s["session_id"])["forks"] == []


def test_refused_fields_are_400s_naming_them_and_counted(stack):
    gw, _, _ = stack
    s = new_session(gw)
    base, key = s["base_url"], {"Authorization": f"Bearer {s['api_key']}"}
    r = httpx.post(f"{base}/responses", json={"input": "x", "conversation": "conv_1"}, headers=key)
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "thread": {}}
    r = httpx.post(f"{base}/messages", json=body, headers=key)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("thread:"), r.text
    refused = trajectory(gw, s["session_id"])["refused"]
    assert refused["responses:conversation"]["count"] == 1 and refused["messages:thread"]["count"] == 1


def test_max_tokens_over_context_reject_is_a_400_naming_the_field(tok, tmp_path, stack):
    _, engine, _ = stack
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "strict", tok, max_tokens_over_context="reject") as gw:
            s = new_session(gw)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
            r = httpx.post(f"{s['base_url']}/chat/completions", json=body, headers=AUTH)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert "max_tokens_over_context" in err["message"]


# -- an engine that does not speak SGLang's event stream -----------------------------------------
def not_sglang_engine() -> FastAPI:
    """TEST DOUBLE: an engine answering a streaming /generate with one JSON object, not SSE."""
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> JSONResponse:
        return JSONResponse({"text": "hi", "output_ids": [1, 2]})

    @app.get("/server_info")
    async def server_info() -> dict:
        return {"context_length": 4096}

    return app


def test_a_stream_from_an_engine_that_is_not_sglang_ends_with_an_error_event(tok, tmp_path):
    with ThreadServer(not_sglang_engine()) as eng, gateway_server(eng.url, tmp_path / "spool", tok) as gw:
        s = new_session(gw)
        msgs = [{"role": "user", "content": "x"}]
        r = httpx.post(
            f"{s['base_url']}/messages",
            json={"model": "tiny", "messages": msgs, "max_tokens": 8, "stream": True},
            headers=AUTH,
            timeout=60,
        )
        evs = events(r.text)
        assert evs[-1][0] == "error", evs
        assert "final chunk" in evs[-1][1]["error"]["message"]
        r = httpx.post(
            f"{s['base_url']}/chat/completions",
            json={"model": "tiny", "messages": msgs, "stream": True},
            headers=AUTH,
            timeout=60,
        )
        chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]" and "final chunk" in json.loads(chunks[-2])["error"]["message"], chunks
        failed = trajectory(gw, s["session_id"])["failed_calls"]
        assert len(failed) == 2 and all("final chunk" in f["message"] for f in failed), failed
