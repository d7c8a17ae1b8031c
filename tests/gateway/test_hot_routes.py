"""The turn routes served by `gateway.hot_routes.HotRoutes` answer as FastAPI's routes answered:
the same request through the app with and without the middleware gets the same status and body
(errors byte for byte, answers but for their ids and times) and the same counts in /metrics; the
three routes skip FastAPI's router, every other request still goes through it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from starlette.routing import Router

from palaestra.gateway.hot_routes import HotRoutes
from palaestra.gateway.service import GatewayService
from palaestra.testing.zero import make_app
from tests.support.servers import ADMIN_KEY, ENV_KEY, ThreadServer, gateway_server

KEY = {"Authorization": f"Bearer {ENV_KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8}
RESPONSES = {"model": "tiny", "input": "Hi.", "max_output_tokens": 8}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8}
ROUTES = [("chat/completions", CHAT), ("responses", RESPONSES), ("messages", MESSAGES)]


@pytest.fixture(scope="module")
def engine(tok):
    reply = tok.encode("Sure.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    with ThreadServer(make_app(reply_ids=reply)) as eng:
        yield eng


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def exchange(url: str, routed: list[str], hot: bool) -> list[tuple[int, Any]]:
    """Every case against the gateway at `url` (answers, auth refusals, bad bodies, an unknown
    session), checking that the turn routes went around FastAPI's router when `hot`."""
    out: list[tuple[int, Any]] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        sid = http.post("/sessions", json={"env": "e", "session_id": "fixed"}, headers=KEY).json()[
            "session_id"
        ]
        for path, body in ROUTES:
            good, bad = orjson.dumps(body), orjson.dumps({**body, "max_tokens": -1, "max_output_tokens": -1})
            cases = [
                (f"/s/{sid}/v1/{path}", KEY, good),
                (f"/s/{sid}/v1/{path}", KEY, bad),
                (f"/s/{sid}/v1/{path}", KEY, b"{not json"),
                (f"/s/{sid}/v1/{path}", KEY, b"[1]"),
                (f"/s/{sid}/v1/{path}", {}, good),
                (f"/s/{sid}/v1/{path}", {"Authorization": f"Bearer {ADMIN_KEY}"}, good),
                (f"/s/{sid}/v1/{path}", {"x-api-key": ENV_KEY}, good),
                (f"/s/nobody/v1/{path}", KEY, good),
            ]
            for target, headers, raw in cases:
                routed.clear()
                r = http.post(target, content=raw, headers={**headers, "content-type": "application/json"})
                out.append((r.status_code, without_ids(r.json())))
                assert (routed == []) == hot, (target, routed)
            routed.clear()
            r = http.get(f"/s/{sid}/v1/{path}", headers=KEY)  # not a turn route: FastAPI's 405
            out.append((r.status_code, r.json()))
            assert routed, "a GET went around FastAPI's router"
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    counted = ("palaestra_gateway_calls_total", "palaestra_gateway_auth_refused_total")
    out.append((0, sorted(line for line in metrics.splitlines() if line.startswith(counted))))
    return out


def test_the_hot_routes_answer_as_fastapis_routes(engine, tok, tmp_path, monkeypatch):
    routed: list[str] = []
    router_call = Router.__call__

    async def counted(self, scope, receive, send):
        if scope["path"].startswith("/s/"):  # not the engine's (a FastAPI app in this process too)
            routed.append(scope["path"])
        await router_call(self, scope, receive, send)

    monkeypatch.setattr(Router, "__call__", counted)
    answers = {}
    for hot in (True, False):
        with gateway_server(engine.url, tmp_path / str(hot), tok) as gw:
            if not hot:  # the app as it was: FastAPI routes every call (inside the body limit)
                assert isinstance(gw.app.front.app, HotRoutes)
                gw.app.front.app = gw.app.stack
            answers[hot] = exchange(gw.url, routed, hot)
    assert answers[True] == answers[False]
    statuses = [status for status, _ in answers[True]]
    assert statuses.count(200) == 6 and {400, 401, 403, 404, 405} <= set(statuses), statuses


def test_an_unexpected_error_is_a_500_in_the_dialects_envelope_and_the_gateway_serves_on(
    engine, tok, tmp_path, monkeypatch
):
    # what FastAPI's last handler answered (app.create_app's `unexpected`), the hot routes answer too
    calls = {"n": 0}

    async def broken(self, session_id, body, dialect, headers=None):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("boom")
        return await chat(self, session_id, body, dialect, headers)

    chat = GatewayService.chat
    monkeypatch.setattr(GatewayService, "chat", broken)
    answers = {}
    for hot in (True, False):
        with gateway_server(engine.url, tmp_path / str(hot), tok) as gw:
            if not hot:
                gw.app.front.app = gw.app.stack
            out = []
            sid = httpx.post(f"{gw.url}/sessions", json={"env": "e"}, headers=KEY).json()["session_id"]
            # FastAPI's stack raises the error on to uvicorn, which closes the connection after the
            # 500: each call on its own connection there; the hot routes keep it open
            with httpx.Client(base_url=gw.url, timeout=60) as kept:
                for path, body in ROUTES:
                    for _ in range(2):  # the first raises, the second answers
                        if hot:
                            r = kept.post(f"/s/{sid}/v1/{path}", json=body, headers=KEY)
                        else:
                            r = httpx.post(f"{gw.url}/s/{sid}/v1/{path}", json=body, headers=KEY, timeout=60)
                        out.append((r.status_code, without_ids(r.json())))
                if hot:  # one connection served all six
                    assert len(kept._transport._pool.connections) == 1  # httpcore's pool
            answers[hot] = out
    assert answers[True] == answers[False]
    assert [status for status, _ in answers[True]] == [500, 200] * 3
    assert answers[True][0][1]["error"]["message"] == "internal gateway error: RuntimeError: boom"
    assert answers[True][4][1]["type"] == "error"  # Anthropic's envelope on /messages


def test_a_client_gone_before_its_body_came_is_no_error(engine, tok, tmp_path, caplog):
    # driven by hand (no server): the turn route's body read meets the disconnect at once
    gw = gateway_server(engine.url, tmp_path, tok)
    svc = gw.app.state.service
    session = svc.sessions.create("e", "t", None, {})
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": f"/s/{session.session_id}/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {ENV_KEY}".encode()), (b"content-length", b"100")],
    }
    with caplog.at_level("ERROR"):
        asyncio.run(gw.app.front(scope, receive, send))
    assert sent == [] and not [r for r in caplog.records if "unexpected" in r.getMessage()]
    assert session.turns == [] and not session.refused
