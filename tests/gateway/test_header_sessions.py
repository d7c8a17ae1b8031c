"""Requests bound to a session by their X-Session-ID header (gateway/header_sessions.py), as
verifiers' eval client sends them: one base URL for every rollout, the rollout's id in a header.
Created on first sight under the environment key, then used like a session made by POST /sessions
(its turns one trajectory, its reward posted by id, its samples in /samples); a session token
cannot open new ones; a missing or malformed header is a 400 naming it. And verifiers' own eval
client (`verifiers.v1.clients.eval.EvalClient`, verifiers 0.4.0 as `make install` installs it) with
its `base_url` at the gateway: its rollouts' turns land in header-bound sessions.

The clients are the real openai and anthropic SDKs; the engine is a SCRIPTED ENGINE (a labelled
TEST DOUBLE, tests/support/servers.py) answering "ok"; the gateway and the tokenizer are real.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

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


# verifiers' EvalClient, as a verifiers eval runs it: two chat turns of one rollout (its trace id)
# and one Anthropic-dialect turn of another. Run outside the checkout: the repository's own
# `verifiers/` folder (palaestra.verifiers) would shadow the library's top-level name inside it.
EVAL_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from verifiers.v1.clients.eval import EvalClient
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.dialects import AnthropicDialect, ChatDialect
    from verifiers.v1.types import SamplingConfig

    async def main(base_url, trace_id):
        config = EvalClientConfig(
            base_url=base_url, api_key_var="PALAESTRA_API_KEY", headers={"X-Palaestra-Env": "verifiers"}
        )
        client = EvalClient(config)
        out, messages = [], [{"role": "user", "content": "hi"}]
        for _ in range(2):
            body = {"model": "tiny", "messages": messages, "max_tokens": 4}
            reply = await client.get_response(ChatDialect(), body, SamplingConfig(), session_id=trace_id)
            text = reply.raw["choices"][0]["message"]["content"]
            out.append(text)
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        reply = await client.get_response(AnthropicDialect(), body, SamplingConfig(), session_id=trace_id + "-b")
        out.append(reply.raw["content"][0]["text"])
        await client.close()
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.slow  # verifiers.v1 imports its whole stack: ~8 s of CPU
def test_verifiers_eval_client_rollouts_land_in_header_bound_sessions(gw, tmp_path):
    try:  # the distribution, not the name (which is palaestra.verifiers' folder inside the checkout)
        assert importlib.metadata.version("verifiers") == "0.4.0"
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("verifiers is not installed: make install installs it (--no-deps: it pins openai<3)")
    script = tmp_path / "eval_client.py"
    script.write_text(EVAL_CLIENT)
    trace = "9d7c0e5a41b34f0e8a2b6c1d3e4f5a6b"
    done = subprocess.run(
        [sys.executable, str(script), f"{gw.url}/v1", trace],
        cwd=tmp_path,
        env={**os.environ, "PALAESTRA_API_KEY": KEY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["ok", "ok", "ok"]
    session = httpx.get(f"{gw.url}/sessions/{trace}", headers=AUTH).json()
    assert session["env"] == "verifiers" and len(session["turns"]) == 2
    assert httpx.get(f"{gw.url}/sessions/{trace}-b", headers=AUTH).json()["env"] == "verifiers"
    httpx.post(f"{gw.url}/sessions/{trace}/reward", headers=AUTH, json={"reward": 0.5}).raise_for_status()
    (sample,) = [
        s for s in httpx.get(f"{gw.url}/samples", headers=AUTH).json()["samples"] if s["session_id"] == trace
    ]
    assert sample["reward"] == 0.5 and sample["loss_mask"].count(1) > 0
