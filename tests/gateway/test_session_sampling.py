"""A session's sampling (gateway/sessions/sampling.py): what the run chose at session creation reaches
the engine on every call, in every dialect, whether the environment passes it or not; a call that
contradicts it is overruled, recorded on the session and counted.

The engine is `ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py) that records the
`sampling_params` the gateway sent; the gateway, the SDK runner and the openai client are real.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from palaestra.gateway.errors import GatewayError
from palaestra.gateway.sessions import sampling as session_sampling
from palaestra.sdk import Environment, Task
from palaestra.sdk.runner import episode_seed
from palaestra.sdk.session import GATEWAY_SAMPLING
from tests.support.servers import ENV_KEY
from tests.support.sessions import AUTH, new_session, rollouts, trajectory

CONTRADICTED = "temperature=1.0 (session sampling 0.0)"


class Forgetful(Environment):
    """An environment that never passes `**session.sampling`: one call without sampling fields, two
    that set their own temperature."""

    name = "forgetful"

    def tasks(self, seed):
        return [Task(task_id=f"t{i}") for i in range(2)]

    async def rollout(self, session, task):
        messages = [{"role": "user", "content": "hi"}]
        await session.client.chat.completions.create(model=self.model, messages=messages, max_tokens=4)
        for _ in range(2):
            await session.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=4, temperature=1.0
            )
        return 1.0


def test_an_environment_forgetting_session_sampling_still_samples_greedy_in_eval(stack, caplog):
    gw, engine, _ = stack
    env = Forgetful()
    with caplog.at_level(logging.WARNING, logger="palaestra.gateway"):
        summary = rollouts(gw.url, ENV_KEY, env, env.tasks(0), sampling={"temperature": 0.0}, seed=3)
    assert summary.statuses == {"completed": 2}, summary.results
    sent = [x.body["sampling_params"] for x in engine.exchanges]
    assert len(sent) == 6 and all(p["temperature"] == 0.0 for p in sent), sent
    assert {p["sampling_seed"] for p in sent} == {episode_seed(3, 0), episode_seed(3, 1)}
    for result in summary.results:
        record = trajectory(gw, result.session_id)
        assert record["sampling"]["temperature"] == 0.0
        assert record["ignored_controls"] == {CONTRADICTED: 2}
    metrics = httpx.get(f"{gw.url}/metrics", headers=AUTH, timeout=60).text
    assert 'palaestra_gateway_sampling_contradicted_total{control="temperature",route="chat"} 4.0' in metrics
    warned = [r.getMessage() for r in caplog.records if "the session's sampling is used" in r.getMessage()]
    assert len(warned) == 2, warned  # once per session
    assert all("env forgetful" in w and CONTRADICTED in w for w in warned), warned


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
        ("completions", {"model": "m", "prompt": "x", "max_tokens": 4}),
        ("responses", {"model": "m", "input": "x", "max_output_tokens": 4}),
        ("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
    ],
)
def test_every_dialect_gets_the_sessions_sampling_and_records_a_contradiction(stack, path, body):
    gw, engine, _ = stack
    s = new_session(gw, sampling={"temperature": 0.0, "top_p": 0.9, "seed": 11})
    headers = {"Authorization": f"Bearer {s['api_key']}", "x-api-key": s["api_key"]}
    for extra in ({}, {"temperature": 0.5}):
        r = httpx.post(f"{s['base_url']}/{path}", json={**body, **extra}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    omitted, contradicting = (x.body["sampling_params"] for x in engine.exchanges[-2:])
    for sent in (omitted, contradicting):  # Messages has no seed field: the session's applies there too
        assert (sent["temperature"], sent["top_p"], sent["sampling_seed"]) == (0.0, 0.9, 11), sent
    route = {"chat/completions": "chat"}.get(path, path)
    assert trajectory(gw, s["session_id"])["ignored_controls"] == {
        "temperature=0.5 (session sampling 0.0)": 1
    }
    metrics = httpx.get(f"{gw.url}/metrics", headers=AUTH, timeout=60).text
    assert (
        f'palaestra_gateway_sampling_contradicted_total{{control="temperature",route="{route}"}} 1.0'
        in metrics
    )


def test_a_session_without_sampling_leaves_its_calls_alone(stack):
    gw, engine, _ = stack
    s = new_session(gw)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0.3}
    r = httpx.post(f"{s['base_url']}/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert engine.exchanges[-1].body["sampling_params"]["temperature"] == 0.3
    record = trajectory(gw, s["session_id"])
    assert record["sampling"] == {} and record["ignored_controls"] == {}


@pytest.mark.parametrize(
    ("sampling", "param", "says"),
    [
        ([0.0], "sampling", "must be an object"),
        ({"temp": 0.0}, "sampling.temp", "the fields are: temperature, top_p"),
        ({"temperature": 2.5}, "sampling.temperature", "a number in [0, 2]; got 2.5"),
        ({"temperature": True}, "sampling.temperature", "got True"),
        ({"temperature": "0"}, "sampling.temperature", "got '0'"),
        ({"seed": 1.5}, "sampling.seed", "must be an integer"),
        ({"seed": 1 << 63}, "sampling.seed", "must be an integer"),
        ({"top_k": -2}, "sampling.top_k", "[-1, 1.07374e+09]"),
    ],
)
def test_bad_session_sampling_is_a_400_naming_the_field(stack, sampling, param, says):
    gw, _, _ = stack
    r = httpx.post(f"{gw.url}/sessions", json={"env": "e", "sampling": sampling}, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_parse_and_the_sdks_keys_agree_with_the_fields():
    assert set(GATEWAY_SAMPLING) == set(session_sampling.FIELDS)
    assert session_sampling.parse(None) == {}
    assert session_sampling.parse({"temperature": 0, "seed": -5}) == {"temperature": 0, "seed": -5}
    with pytest.raises(GatewayError, match="not a sampling field"):
        session_sampling.parse({"max_tokens": 4})
    sampling = {"temperature": 1.0, "top_p": 1.0}
    assert session_sampling.apply({"top_p": 0.0}, {}, sampling) == []
    assert sampling == {"temperature": 1.0, "top_p": 1e-6}  # as the dialects map top_p 0
