"""Requests bound to a session by their X-Session-ID header (gateway/header_sessions.py), as
verifiers' eval client sends them: one base URL for every rollout, the rollout's id in a header.
Created on first sight under the environment key, then used like a session made by POST /sessions
(its turns one trajectory, its reward posted by id, its samples in /samples); a session token
cannot open new ones; a missing or malformed header is a 400 naming it.

The clients are the real openai and anthropic SDKs; the engine is a SCRIPTED ENGINE (a labelled
TEST DOUBLE, tests/support/servers.py) answering "ok"; the gateway and the tokenizer are real.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = "k-env"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(tok, tmp_path_factory):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ok = tok.encode("ok", add_special_tokens=False)
    with ThreadServer(ScriptedEngine(lambda ids, i: ok + [end], stop_ids={end}).app()) as eng:
        with gateway_server(eng.url, tmp_path_factory.mktemp("spool"), tok, api_key=KEY) as server:
            yield server


def client(gw, key: str = KEY, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, default_headers=headers, max_retries=0)


def test_a_rollout_id_seen_first_opens_a_session_its_turns_and_reward_follow(gw):
    rollout = "3f0c9a1e2b7d4c56a8e9f0b1c2d3e4f5"  # a verifiers trace id: uuid4().hex
    agent = client(gw, **{"X-Session-ID": rollout, "X-Palaestra-Env": "vf-math", "X-Palaestra-Task-ID": "q7"})
    first = agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert first.choices[0].message.content == "ok"
    history = [*MESSAGES, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    agent.chat.completions.create(model="tiny", messages=history, max_tokens=4)

    session = httpx.get(f"{gw.url}/sessions/{rollout}", headers=AUTH).json()
    assert (session["env"], session["task_id"], session["group_id"]) == ("vf-math", "q7", "vf-math/q7")
    assert session["metadata"] == {"bound_by": "X-Session-ID"} and len(session["turns"]) == 2
    r = httpx.post(f"{gw.url}/sessions/{rollout}/reward", headers=AUTH, json={"reward": 1.0})
    assert r.status_code == 200, r.text
    samples = httpx.get(f"{gw.url}/samples", headers=AUTH).json()["samples"]
    ours = [s for s in samples if s["session_id"] == rollout]
    assert len(ours) == 1 and ours[0]["reward"] == 1.0 and ours[0]["env"] == "vf-math"  # one trajectory


def test_the_anthropic_sdk_and_the_responses_api_bind_the_same_way(gw):
    claude = anthropic.Anthropic(
        base_url=gw.url, api_key=KEY, default_headers={"X-Session-ID": "ant-1"}, max_retries=0
    )
    reply = claude.messages.create(model="tiny", max_tokens=4, messages=MESSAGES)
    assert reply.content[0].text == "ok"
    answer = client(gw, **{"X-Session-ID": "resp-1"}).responses.create(
        model="tiny", input="hi", max_output_tokens=4
    )
    assert answer.output_text == "ok"
    for sid in ("ant-1", "resp-1"):
        assert httpx.get(f"{gw.url}/sessions/{sid}", headers=AUTH).json()["env"] == "default"


def test_a_session_token_uses_its_own_session_by_header_but_cannot_open_one(gw):
    made = httpx.post(f"{gw.url}/sessions", headers=AUTH, json={"env": "e", "task_id": "t"}).json()
    own = client(gw, made["api_key"], **{"X-Session-ID": made["session_id"]})
    assert (
        own.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4).choices[0].message.content
    )
    stray = client(gw, made["api_key"], **{"X-Session-ID": "new-rollout"})
    with pytest.raises(openai.PermissionDeniedError):
        stray.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert httpx.get(f"{gw.url}/sessions/new-rollout", headers=AUTH).status_code == 404  # none made


@pytest.mark.parametrize(
    ("headers", "needle"),
    [({}, "has none: send X-Session-ID"), ({"X-Session-ID": "a/b"}, "letters, digits and dashes")],
    ids=["missing", "malformed"],
)
def test_a_missing_or_malformed_header_is_a_400_naming_it(gw, headers, needle):
    with pytest.raises(openai.BadRequestError, match=needle) as err:
        client(gw, **headers).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert err.value.body["param"] == "X-Session-ID"
