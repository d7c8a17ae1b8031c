"""Routing with placement off (the default): today's header only, per-env traffic counted, the record.

The engine is `ScriptedEngine`, a TEST DOUBLE that records the headers of every /generate call;
placement itself is tested against the real router and real engines in test_routing_engines.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from palaestra.gateway.routing import EngineRouting, RoutingOptions
from tests.support.servers import ADMIN_KEY, ScriptedEngine, TextScript, ThreadServer, gateway_server
from tests.support.sessions import AUTH, new_session, reward


def chat(gw, sid: str, messages: list[dict]) -> dict:
    r = httpx.post(
        f"{gw.url}/s/{sid}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 8},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def routed(tok, tmp_path):
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    record = tmp_path / "routing.jsonl"
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok, routing_trace=str(record)) as gw:
            yield gw, engine, record


def test_placement_off_sends_the_session_routing_key_only(routed):
    gw, engine, record = routed
    sessions = [new_session(gw, env="math", group_id="g1")["session_id"] for _ in range(2)]
    for sid in sessions:
        msgs = [{"role": "user", "content": "What is 2 + 2?"}]
        answer = chat(gw, sid, msgs)
        msgs += [answer["choices"][0]["message"], {"role": "user", "content": "And 3 + 3?"}]
        chat(gw, sid, msgs)
    assert len(engine.exchanges) == 4
    for ex, sid in zip(engine.exchanges, [sessions[0]] * 2 + [sessions[1]] * 2, strict=True):
        assert ex.headers["x-smg-routing-key"] == sid
        assert "x-smg-target-worker" not in ex.headers

    snap = httpx.get(f"{gw.url}/admin/routing", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert snap["mode"] == "routing_key" and "placement" not in snap
    prompts = [len(ex.body["input_ids"]) for ex in engine.exchanges]
    assert snap["traffic"]["math"]["calls"] == 4
    assert snap["traffic"]["math"]["prompt_tokens"] == sum(prompts)
    metrics = httpx.get(f"{gw.url}/metrics", headers=AUTH).text
    assert 'palaestra_gateway_routing_calls_total{env="math"} 4.0' in metrics
    assert 'palaestra_gateway_routing_sessions_total{env="math"} 2.0' in metrics

    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["session"], r["turn"]) for r in rows] == [
        (sessions[0], 0),
        (sessions[0], 1),
        (sessions[1], 0),
        (sessions[1], 1),
    ]
    assert [r["prompt_tokens"] for r in rows] == prompts
    assert all(r["env"] == "math" and r["group"] == "g1" and r["worker"] is None for r in rows)
    # the two sessions of the group start from the same prompt: the record says how much they share
    assert rows[2]["shared_group"] == rows[2]["prompt_tokens"] == rows[0]["prompt_tokens"]


def test_the_record_converts_to_a_replayable_trace(routed):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import routing_trace

    gw, engine, record = routed
    for g in ("ga", "gb"):
        for _ in range(3):
            sid = new_session(gw, env="math", group_id=g)["session_id"]
            msgs = [{"role": "user", "content": f"task {g}"}]
            answer = chat(gw, sid, msgs)
            msgs += [answer["choices"][0]["message"], {"role": "user", "content": "go on"}]
            chat(gw, sid, msgs)
            reward(gw, sid)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    groups, caps = routing_trace.convert_record(rows)
    assert sorted(g.group for g in groups) == ["ga", "gb"]
    assert all(len(g.sessions) == 3 for g in groups) and all(
        len(s.turns) == 2 for g in groups for s in g.sessions
    )
    by_session = {r["session"]: r for r in rows if r["turn"] == 0}
    for g in groups:
        assert (
            g.env_prefix + g.group_prefix + g.sessions[0].turns[0].new
            == by_session[g.sessions[0].session]["prompt_tokens"]
        )
        # every later turn adds exactly what the gateway sent beyond the previous prompt and answer
        for s in g.sessions:
            calls = [r for r in rows if r["session"] == s.session]
            assert (
                s.turns[1].new
                == calls[1]["prompt_tokens"] - calls[0]["prompt_tokens"] - calls[0]["output_tokens"]
            )
    assert caps["math"] >= 1


def test_the_router_worker_list_unknown_keeps_the_routing_key(tmp_path):
    """Placement on against something that is not an sglang-router: it says so and routes as today."""
    import asyncio

    from prometheus_client import CollectorRegistry

    async def check() -> None:
        routing = EngineRouting(RoutingOptions(placement=True), "http://127.0.0.1:9", CollectorRegistry())
        await routing.refresh_workers()
        call = routing.route("s1", "e", None, [1, 2, 3], 4)
        assert call.headers() == {"X-SMG-Routing-Key": "s1"}
        assert "failed" in (routing.snapshot()["workers_error"] or "")
        await routing.close()

    asyncio.run(check())
