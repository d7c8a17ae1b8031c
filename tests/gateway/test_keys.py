"""The gateway's three credentials, route by route: admin key, environment key, session token.

Every route of the app (iterated from `app.routes`, so a route added without a row in `POLICY`
fails here) is called with every kind of credential — none, a wrong key, the admin key, the
environment key, the target session's own token, another session's token — each as
`Authorization: Bearer` and as `x-api-key`, and must be allowed (200) or refused (401/403 in the
route's dialect's error shape) exactly as `POLICY` says. Then what an agent holding a session token
would try: post its reward, read another session, reach admin; and that the SDK hands an agent its
session's token, never the environment key.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/gateway/test_keys.py

The engine is `ScriptedEngine`, a TEST DOUBLE speaking SGLang's /generate (this file is about who
may call what, not generation); the gateway, its routes and the tokenizer are real.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fastapi.routing import iter_route_contexts
from prometheus_client.parser import text_string_to_metric_families

from palaestra.sdk import Environment, GatewayClient, Task, run_rollouts
from tests.support.servers import INSECURE, ScriptedEngine, ThreadServer, gateway_server

ENV_KEY, ADMIN_KEY = "k-env", "k-admin"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (method, path) -> (who may call it, request body). Who: "public" (anyone), "admin" (the admin
# key), "env" (the environment key), "session" (the environment key or that session's own token).
POLICY: dict[tuple[str, str], tuple[str, dict | None]] = {
    ("GET", "/health"): ("public", None),
    # FastAPI's own schema pages: the OpenAPI document names routes, never data.
    ("GET", "/openapi.json"): ("public", None),
    ("GET", "/docs"): ("public", None),
    ("GET", "/docs/oauth2-redirect"): ("public", None),
    ("GET", "/redoc"): ("public", None),
    ("GET", "/metrics"): ("env", None),
    ("POST", "/sessions"): ("env", {"env": "keys", "task_id": "t"}),
    ("GET", "/sessions/{session_id}"): ("env", None),
    ("POST", "/sessions/{session_id}/reward"): ("env", {"reward": 1.0}),
    ("GET", "/samples"): ("env", None),
    ("GET", "/samples/stream"): ("env", None),
    ("POST", "/samples/ack"): ("env", {"cursor": 0}),
    ("POST", "/admin/pause"): ("admin", None),
    ("POST", "/admin/resume"): ("admin", None),
    ("GET", "/admin/routing"): ("admin", None),
    ("POST", "/s/{session_id}/v1/chat/completions"): ("session", CHAT),
    ("POST", "/s/{session_id}/v1/completions"): ("session", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
    ("POST", "/s/{session_id}/v1/responses"): ("session", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
    ("GET", "/s/{session_id}/v1/models"): ("session", None),
    ("POST", "/s/{session_id}/v1/messages"): ("session", CHAT),
    ("POST", "/s/{session_id}/v1/messages/count_tokens"): ("session", {"model": "tiny", "messages": CHAT["messages"]}),
    # the same routes without the session in the path: its id is the X-Session-ID header
    ("POST", "/v1/chat/completions"): ("session", CHAT),
    ("POST", "/v1/completions"): ("session", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
    ("POST", "/v1/responses"): ("session", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
    ("GET", "/v1/models"): ("session", None),
    ("POST", "/v1/messages"): ("session", CHAT),
}  # fmt: skip

CREDENTIALS = ("none", "wrong", "admin", "env", "own_token", "other_token")

ALLOWED = {
    "public": set(CREDENTIALS),
    "admin": {"admin"},
    "env": {"env"},
    "session": {"env", "own_token"},
}


def app_routes(app) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, included routers' routes with their prefixes."""
    routes = set()
    for route in iter_route_contexts(app.routes):
        assert route.path and route.methods, f"a route that is not an HTTP route: {route!r}"
        routes.update((method, route.path) for method in route.methods - {"HEAD"})
    return routes


def scripted_engine(tok) -> ScriptedEngine:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ok = tok.encode("ok", add_special_tokens=False)
    return ScriptedEngine(lambda ids, i: ok + [end], stop_ids={end})


@pytest.fixture(scope="module")
def gateway(tok, tmp_path_factory):
    with ThreadServer(scripted_engine(tok).app()) as eng:
        spool = tmp_path_factory.mktemp("spool")
        with gateway_server(
            eng.url, spool, tok, api_key=ENV_KEY, admin_key=ADMIN_KEY, pause_mode="reject"
        ) as gw:
            yield gw.app, gw


def new_session(gw, **auth) -> dict:
    r = httpx.post(
        f"{gw.url}/sessions",
        json={"env": "keys", "task_id": "t"},
        headers={"Authorization": f"Bearer {ENV_KEY}"},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_every_route_has_a_declared_policy(gateway):
    app, _ = gateway
    routes = app_routes(app)
    assert routes - POLICY.keys() == set(), "routes without a row in POLICY: declare who may call them"
    assert POLICY.keys() - routes == set(), "POLICY rows for routes the app no longer has"


def call(gw, method: str, path: str, body, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=30, trust_env=False) as client:
        if path.endswith("/stream"):  # an endless event stream: its status is all this needs
            with client.stream(method, path, params={"heartbeat_s": 0.1}, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                return r
        return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
@pytest.mark.parametrize("credential", CREDENTIALS)
@pytest.mark.parametrize("route", sorted(POLICY), ids=lambda r: f"{r[0]} {r[1]}")
def test_route_by_credential(gateway, route, credential, header):
    _, gw = gateway
    method, path = route
    who, body = POLICY[route]
    target, other = new_session(gw), new_session(gw)
    key = {
        "none": None,
        "wrong": "not-a-key",
        "admin": ADMIN_KEY,
        "env": ENV_KEY,
        "own_token": target["api_key"],
        "other_token": other["api_key"],
    }[credential]
    headers = (
        {}
        if key is None
        else {"authorization": f"Bearer {key}"}
        if header == "authorization"
        else {header: key}
    )
    if path.startswith("/v1/"):  # gateway/header_sessions.py: the session named by a header
        headers["X-Session-ID"] = target["session_id"]
    r = call(gw, method, path.replace("{session_id}", target["session_id"]), body, headers)
    if path == "/admin/pause" and r.status_code == 200:  # never leave generation paused for the next case
        httpx.post(
            f"{gw.url}/admin/resume", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).raise_for_status()
    if credential in ALLOWED[who]:
        assert r.status_code == 200, f"{method} {path} with {credential}: {r.status_code} {r.text}"
        return
    expected = 401 if credential in ("none", "wrong") else 403
    assert r.status_code == expected, f"{method} {path} with {credential}: {r.status_code} {r.text}"
    answer = r.json()
    if path.endswith("/messages") or path.endswith("/count_tokens"):  # Anthropic's envelope
        kind = "authentication_error" if expected == 401 else "permission_error"
        assert answer["type"] == "error" and answer["error"]["type"] == kind
        message = answer["error"]["message"]
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        message = answer["error"]["message"]
    assert path.replace("{session_id}", target["session_id"]) in message  # names the route refused
    if credential == "other_token":
        assert f"/s/{other['session_id']}/v1" in message  # and says what the token does open


def refused(gw) -> dict[tuple[str, str], float]:
    """palaestra_gateway_auth_refused_total by (scope, status)."""
    text = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {ENV_KEY}"}).text
    return {
        (s.labels["scope"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "palaestra_gateway_auth_refused_total"
    }


def test_session_answer_carries_a_token_that_opens_only_its_session(gateway):
    _, gw = gateway
    a, b = new_session(gw), new_session(gw)
    assert set(a) == {"session_id", "group_id", "base_url", "api_key"}
    assert a["api_key"] not in (ENV_KEY, ADMIN_KEY) and a["api_key"] != b["api_key"]
    agent = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
    assert agent.chat.completions.create(**CHAT).choices[0].message.content == "ok"
    # the same token, pointed at session b: the OpenAI SDK raises PermissionDeniedError (403)
    stray = openai.OpenAI(base_url=b["base_url"], api_key=a["api_key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="opens only its own session"):
        stray.chat.completions.create(**CHAT)
    # an unknown session is a 403 too (the token is real, the session is not its own), not a 404
    r = httpx.get(f"{gw.url}/s/nope/v1/models", headers={"Authorization": f"Bearer {a['api_key']}"})
    assert r.status_code == 403


def test_a_session_token_cannot_reward_read_or_administer(gateway):
    _, gw = gateway
    a, b = new_session(gw), new_session(gw)
    as_agent = {"Authorization": f"Bearer {a['api_key']}"}
    before = refused(gw)
    for method, path, body in (
        ("POST", f"/sessions/{a['session_id']}/reward", {"reward": 1.0}),  # its own reward
        ("GET", f"/sessions/{b['session_id']}", None),  # another session's trajectory
        ("GET", f"/sessions/{a['session_id']}", None),  # even its own
        ("POST", "/sessions", {"env": "keys"}),  # a session of its own making
        ("GET", "/samples", None),
        ("GET", "/metrics", None),
        ("POST", "/admin/pause", None),
    ):
        r = httpx.request(method, f"{gw.url}{path}", json=body, headers=as_agent)
        assert r.status_code == 403, (path, r.text)
        assert "session token opens only its own session's routes" in r.json()["error"]["message"]
    after = refused(gw)  # counted in /metrics: six environment routes, one admin route
    assert after[("environment", "403")] - before.get(("environment", "403"), 0) == 6
    assert after[("admin", "403")] - before.get(("admin", "403"), 0) == 1
    env = {"Authorization": f"Bearer {ENV_KEY}"}
    trajectory = httpx.get(f"{gw.url}/sessions/{a['session_id']}", headers=env).json()
    assert (
        trajectory["finished"] is False and trajectory["reward"] is None
    )  # the refused reward left no trace
    assert a["api_key"] not in str(trajectory)  # and the trajectory does not give the token away


def test_insecure_local_checks_nothing_but_still_returns_tokens(tok, tmp_path):
    with ThreadServer(scripted_engine(tok).app()) as eng:
        with gateway_server(eng.url, tmp_path, tok, **INSECURE) as gw:
            s = httpx.post(f"{gw.url}/sessions", json={"env": "keys"}).json()
            assert s["api_key"].startswith("pst_")
            other = httpx.post(f"{gw.url}/sessions", json={"env": "keys"}).json()
            stray = openai.OpenAI(base_url=s["base_url"], api_key=other["api_key"], max_retries=0)
            assert stray.chat.completions.create(**CHAT).choices[0].message.content == "ok"
            assert httpx.post(f"{gw.url}/admin/pause").status_code == 200


class Snoop(Environment):
    """An agent that tries its client's key outside its own session (and then does its episode)."""

    name = "snoop"

    def __init__(self, gateway_url: str):
        self.gateway_url = gateway_url
        self.seen: list[dict] = []

    def tasks(self, seed):
        return [Task("t0"), Task("t1")]

    async def rollout(self, session, task):
        key = session.client.api_key
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=self.gateway_url, trust_env=False) as http:
            own_reward = await http.post(
                f"/sessions/{session.session_id}/reward", json={"reward": 9.0}, headers=headers
            )
            samples = await http.get("/samples", headers=headers)
        reply = await session.client.chat.completions.create(**CHAT)
        self.seen.append(
            {"sid": session.session_id, "key": key, "token": session.api_key, "reward": own_reward.status_code,
             "samples": samples.status_code, "reply": reply.choices[0].message.content}
        )  # fmt: skip
        return 1.0


def test_the_sdk_gives_an_agent_its_session_token_never_the_environment_key(gateway):
    """`GatewayClient.session()` (what `run_rollouts`, the CLI and the run's RolloutWorker use)."""
    _, gw = gateway
    env = Snoop(gw.url)

    async def run():
        client = GatewayClient(gw.url, ENV_KEY)
        try:
            return await run_rollouts(env, client, env.tasks(0), samples_per_task=2, progress=False)
        finally:
            await client.close()

    summary = asyncio.run(run())
    assert summary.statuses == {"completed": 4}, [r.error for r in summary.results]
    assert len({s["key"] for s in env.seen}) == 4  # one token per session
    for seen in env.seen:
        assert seen["key"] == seen["token"] and seen["key"].startswith(f"pst_{seen['sid']}.")
        assert seen["key"] not in (ENV_KEY, ADMIN_KEY)
        assert seen["reward"] == 403 and seen["samples"] == 403 and seen["reply"] == "ok"
    # the rewards that count are the environment's (1.0), not the 9.0 the agent tried to post
    assert {r.reward for r in summary.results} == {1.0}


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ([(b"authorization", b"Bearer k1")], "k1"),
        ([(b"authorization", b"bEaReR   k1  ")], "k1"),
        ([(b"x-api-key", b"k2")], "k2"),
        ([(b"x-api-key", b"k2"), (b"authorization", b"Bearer k1")], "k1"),  # a bearer token first
        ([(b"authorization", b"Basic abc"), (b"x-api-key", b"k2")], "k2"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer k1"), (b"authorization", b"Bearer k3")], "k1"),  # the first value
        ([(b"x-api-key", b"k2"), (b"x-api-key", b"k4")], "k2"),
        ([(b"authorization", "Bearer clé".encode("latin-1"))], "clé"),  # latin-1, as Starlette reads it
        ([(b"content-type", b"application/json")], None),
    ],
)
def test_the_presented_key_is_read_from_the_raw_headers_as_starlettes_headers_read_it(headers, key):
    from starlette.requests import Request

    from palaestra.gateway.auth import presented_key

    request = Request({"type": "http", "headers": headers})
    assert presented_key(request) == key
    # what the earlier reading through `request.headers` gave
    auth = request.headers.get("authorization", "")
    assert key == (auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key"))
