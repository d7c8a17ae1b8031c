"""Routing with placement off (the default against one engine): the routing key only, per-env
traffic counted, the record; the default's decision (`placement.enabled: auto`: on where the engine
URL lists its workers, off otherwise); what the gateway sends around placement's decisions.

The engine is `ScriptedEngine`, a TEST DOUBLE that records the headers of every /generate call;
placement itself is tested against the real router and real engines in test_routing_engines.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from palaestra.gateway.engine_side.placement import PlacementConfig
from palaestra.gateway.engine_side.routing import EngineRouting, RoutingOptions
from tests.support.servers import ADMIN_KEY, ScriptedEngine, TextScript, ThreadServer, gateway_server
from tests.support.sessions import AUTH, new_session, reward, samples

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


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
    assert snap["placement_enabled"] == "auto"  # the default, off here: one engine lists no workers
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
        routing = EngineRouting(
            RoutingOptions(placement=PlacementConfig(enabled="on")), "http://127.0.0.1:9", CollectorRegistry()
        )
        await routing.refresh_workers()
        call = routing.route("s1", "e", None, [1, 2, 3], 4)
        assert call.call_headers() == {"X-SMG-Routing-Key": "s1"}
        assert "failed" in (routing.snapshot()["workers_error"] or "")
        await routing.close()

    asyncio.run(check())


def workers_server(listed: bool, scheme: str = "http") -> tuple[ThreadServer, list[int]]:
    """A TEST DOUBLE of the engine URL: with `listed`, a router whose GET /workers lists two workers
    (`scheme`://10.0.0.i:30000); without, one engine (a 404 there, as the embedded engine and SGLang's
    server answer). The list counts the GET /workers it answered."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, asked = FastAPI(), []

    @app.get("/workers")
    async def workers():
        asked.append(1)
        if not listed:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"workers": [{"url": f"{scheme}://10.0.0.{i}:30000", "is_healthy": True} for i in range(2)]}

    return ThreadServer(app), asked


def routed_by(enabled: str, url: str, check) -> None:
    """Starts an `EngineRouting` with `placement.enabled` against `url` as the gateway's lifespan
    does (its first GET /workers answered), runs `check(routing)` (awaited if it is a coroutine) in
    the same event loop, and closes it."""
    import asyncio
    import inspect

    from prometheus_client import CollectorRegistry

    async def run() -> None:
        routing = EngineRouting(
            RoutingOptions(placement=PlacementConfig(enabled=enabled)), url, CollectorRegistry()
        )
        await routing.start()
        try:
            result = check(routing)
            if inspect.isawaitable(result):
                await result
        finally:
            await routing.close()

    asyncio.run(run())


def test_the_default_places_where_the_engine_url_lists_its_workers(caplog):
    server, asked = workers_server(listed=True)

    def check(routing: EngineRouting) -> None:
        assert routing.placement is not None and len(routing.placement.workers) == 2
        headers = routing.route("s1", "math", None, [1, 2, 3], 4).call_headers()
        assert headers["X-SMG-Routing-Key"] == "s1" and headers["X-SMG-Target-Worker"] in ("0", "1")
        snap = routing.snapshot()
        assert snap["mode"] == "placement" and snap["placement_enabled"] == "auto"
        assert routing._task is not None and not routing._task.done()  # the list is kept fresh

    with server, caplog.at_level("INFO", logger="palaestra.gateway.engine_side.routing"):
        routed_by("auto", server.url, check)
    assert asked == [1]
    assert "placement on: " in caplog.text and "lists 2 worker(s)" in caplog.text


def test_the_default_against_one_engine_is_the_routing_key_only_and_says_so_once(caplog):
    server, asked = workers_server(listed=False)

    def check(routing: EngineRouting) -> None:
        assert routing.placement is None and routing._task is None  # never asked again
        assert routing.route("s1", "math", None, [1, 2, 3], 4).call_headers() == {"X-SMG-Routing-Key": "s1"}
        snap = routing.snapshot()
        assert snap["mode"] == "routing_key" and "placement" not in snap

    with server, caplog.at_level("INFO", logger="palaestra.gateway.engine_side.routing"):
        routed_by("auto", server.url, check)
    assert asked == [1]
    lines = [r for r in caplog.records if r.name == "palaestra.gateway.engine_side.routing"]
    assert len(lines) == 1 and lines[0].levelname == "INFO", [r.getMessage() for r in lines]
    assert "placement off: GET" in lines[0].getMessage() and "answered 404" in lines[0].getMessage()


def test_explicit_off_never_asks_for_workers_even_from_a_router():
    server, asked = workers_server(listed=True)

    def check(routing: EngineRouting) -> None:
        assert routing.placement is None
        assert routing.route("s1", "math", None, [1], 4).call_headers() == {"X-SMG-Routing-Key": "s1"}
        assert routing.snapshot()["mode"] == "routing_key"

    with server:
        routed_by("off", server.url, check)
    assert asked == []


def test_explicit_on_against_one_engine_warns_naming_the_option_and_keeps_the_routing_key(caplog):
    server, _ = workers_server(listed=False)

    def check(routing: EngineRouting) -> None:
        assert routing.route("s1", "math", None, [1], 4).call_headers() == {"X-SMG-Routing-Key": "s1"}

    with server, caplog.at_level("INFO", logger="palaestra.gateway.engine_side.routing"):
        routed_by("on", server.url, check)
    (line,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "answered 404" in line.getMessage() and "gateway.placement.enabled=auto" in line.getMessage()


def test_the_default_waits_for_an_answer_before_deciding(caplog):
    """The engine URL not up when the gateway starts: the routing key meanwhile, decided by the first
    answer (here one engine: off)."""
    server, asked = workers_server(listed=False)  # its port is chosen, nothing listens yet

    async def check(routing: EngineRouting) -> None:
        assert routing.undecided and routing.placement is not None
        assert routing.route("s1", "math", None, [1], 4).call_headers() == {"X-SMG-Routing-Key": "s1"}
        assert routing.snapshot()["mode"] == "routing_key"
        assert "placement (auto) undecided" in caplog.text and "WARNING" not in caplog.text
        with server:
            await routing.refresh_workers()
        assert not routing.undecided and routing.placement is None and asked == [1]

    with caplog.at_level("INFO", logger="palaestra.gateway.engine_side.routing"):
        routed_by("auto", server.url, check)


@pytest.mark.parametrize("engine_http", ["bare", "auto", "aiohttp"])
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_routing_replay_refuses_https_workers_at_start_with_the_bare_client_only(engine_http, scheme):
    """Routing replay posts to the workers' own URLs: an https:// one in the router's list with
    gateway.engine_http bare stops the start in one line naming the option and the URL (before, each
    call failed as a 500); auto (its aiohttp fallback) and aiohttp take it, and http:// is fine with all."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from palaestra.gateway.engine_side.engine_http import open_http

    server, asked = workers_server(listed=True, scheme=scheme)

    async def run() -> None:
        http = open_http(engine_http, server.url, max_connections=1, connect_timeout_s=1, timeout_s=1)
        routing = EngineRouting(RoutingOptions(direct=True), server.url, CollectorRegistry(), http.serves)
        try:
            if engine_http == "bare" and scheme == "https":
                with pytest.raises(ValueError) as caught:
                    await routing.start()
                message = str(caught.value)
                assert "\n" not in message and "gateway.engine_http is bare" in message
                assert "https://10.0.0.0:30000" in message and "auto or aiohttp" in message
            else:
                await routing.start()
                assert [w.url for w in routing.placement.workers] == [
                    f"{scheme}://10.0.0.{i}:30000" for i in range(2)
                ]
        finally:
            await routing.close()
            await http.close()

    with server:
        asyncio.run(run())
    assert asked == [1]


class ListedRouter:
    """TEST DOUBLE of sglang-router around the scripted engine: `GET /workers` lists `urls` (every
    call reaches the scripted engine whatever worker its header names), and the next `refuse` calls
    are answered 503 `no_available_workers`, as the router answers a target it does not hold
    (their headers go to `refused`). The placement decisions themselves are test_placement.py's;
    this checks what the gateway sends around them."""

    def __init__(self, engine: ScriptedEngine, urls: list[str]) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        self.urls = list(urls)
        self.refuse = 0
        self.refused: list[dict[str, str]] = []
        self.fail = 0  # the next `fail` calls: a 500 from the engine itself (nothing generated)
        self.failed: list[dict[str, str]] = []
        self.app = engine.app()

        @self.app.get("/workers")
        async def workers() -> dict:
            return {
                "workers": [{"url": u, "id": f"w{i}", "is_healthy": True} for i, u in enumerate(self.urls)]
            }

        @self.app.middleware("http")
        async def refuse(request: Request, call_next):
            if request.url.path == "/generate" and self.refuse > 0:
                self.refuse -= 1
                self.refused.append({k.lower(): v for k, v in request.headers.items()})
                return JSONResponse({"error": {"code": "no_available_workers"}}, status_code=503)
            if request.url.path == "/generate" and self.fail > 0:
                self.fail -= 1
                self.failed.append({k.lower(): v for k, v in request.headers.items()})
                return JSONResponse(
                    {"error": {"message": "CUDA error: an illegal memory access"}}, status_code=500
                )
            return await call_next(request)


def play_sessions(gw, n: int = 3, turns: int = 3, between=None) -> list[str]:
    """n sessions of one group, `turns` turns each, interleaved; `between(k)` runs before turn k."""
    sids = [new_session(gw, env="math", group_id="g")["session_id"] for _ in range(n)]
    msgs: dict[str, list[dict]] = {sid: [] for sid in sids}
    for k in range(turns):
        if between is not None:
            between(k)
        for i, sid in enumerate(sids):
            msgs[sid].append({"role": "user", "content": f"session {i} turn {k}: what is {k} + {i}?"})
            msgs[sid].append(chat(gw, sid, msgs[sid])["choices"][0]["message"])
    for sid in sids:
        reward(gw, sid)
    return sids


def placed_run(tok, spool, enabled: str) -> dict:
    """Three sessions through a gateway over `ListedRouter` with `placement.enabled` (auto: the
    default, on since the router lists its workers); with placement, the first session's worker is
    removed from the router before turn 1 and the router refuses a target at turn 2."""
    placement = enabled != "off"
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    router = ListedRouter(engine, [f"http://10.0.0.{i}:30000" for i in range(3)])
    with (
        ThreadServer(router.app) as eng,
        gateway_server(eng.url, spool, tok, placement=PlacementConfig(enabled=enabled)) as gw,
    ):

        def admin() -> dict:
            return httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()

        def disturb(k: int) -> None:
            if not placement or k == 0:
                return
            if k == 1:  # the first session's worker is removed from the router
                first = engine.exchanges[0].headers["x-smg-target-worker"]
                router.urls.remove(admin()["placement"]["workers"][int(first)]["url"])
                deadline = time.monotonic() + 60
                while len(admin()["placement"]["workers"]) != 2:
                    assert time.monotonic() < deadline, "the gateway never read the router's new worker list"
                    time.sleep(0.1)
            if k == 2:  # the router refuses the next target: the call is re-placed, not failed
                router.refuse = 1

        assert admin()["mode"] == ("placement" if placement else "routing_key")
        assert admin()["placement_enabled"] == enabled
        sids = play_sessions(gw, between=disturb)
        got = [s for s in samples(gw)["samples"] if s["session_id"] in sids]
        return {
            "bodies": [ex.body for ex in engine.exchanges],
            "headers": [ex.headers for ex in engine.exchanges],
            "keys": [sids.index(ex.headers["x-smg-routing-key"]) for ex in engine.exchanges],
            "samples": sorted((sids.index(s["session_id"]), s["tokens"], s["loss_mask"]) for s in got),
            "refused": router.refused,
            "snap": admin(),
        }


def test_placement_never_changes_what_the_engine_is_sent_or_the_samples(tok, tmp_path):
    """Same sessions with placement off and on (the default, auto, over a router), a worker removed
    and a target refused on the way: every /generate body and every sample is the same; only the
    routing headers differ."""
    off = placed_run(tok, tmp_path / "off", enabled="off")
    on = placed_run(tok, tmp_path / "on", enabled="auto")
    assert on["bodies"] == off["bodies"] and len(on["bodies"]) == 9
    assert on["samples"] == off["samples"] and len(on["samples"]) == 3
    assert all("x-smg-target-worker" not in h for h in off["headers"])
    assert all("x-smg-target-worker" in h for h in on["headers"])
    assert on["keys"] == off["keys"] == [0, 1, 2] * 3  # the routing key is today's in both: the session id
    assert len(on["refused"]) == 1  # refused once, then answered on a re-placed target
    moves = on["snap"]["placement"]["moves_by_reason"]
    assert moves.get("worker_gone", 0) >= 2, moves  # the removed worker's sessions, and the refused call
    assert on["snap"]["placement"]["refusals"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_a_call_an_engine_fails_is_moved_to_another_engine_and_counted(tok, tmp_path, stream):
    """An engine that answers a call with an error (a 500, nothing generated): the call is placed on
    another worker at once, the agent gets its answer, and the move is counted (issue 37)."""
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    router = ListedRouter(engine, [f"http://10.0.0.{i}:30000" for i in range(3)])
    with (
        ThreadServer(router.app) as eng,
        gateway_server(eng.url, tmp_path, tok, placement=PlacementConfig(enabled="on")) as gw,
    ):
        sid = new_session(gw, env="math")["session_id"]
        msgs = [{"role": "user", "content": "what is 1 + 1?"}]
        msgs.append(chat(gw, sid, msgs)["choices"][0]["message"])
        msgs.append({"role": "user", "content": "and 2 + 2?"})
        router.fail = 1
        body = {"messages": msgs, "max_tokens": 16, "stream": stream}
        r = httpx.post(f"{gw.url}/s/{sid}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and ("[DONE]" in r.text if stream else r.json()["choices"]), r.text
        (failed,) = router.failed
        first, retried = engine.exchanges[0].headers, engine.exchanges[-1].headers
        assert len(engine.exchanges) == 2  # the failed call never reached the engine's double
        assert failed["x-smg-target-worker"] == first["x-smg-target-worker"]  # the session's worker failed
        snap = httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()["placement"]
        workers = snap["workers"]
        assert (
            workers[int(retried["x-smg-target-worker"])]["url"]
            != workers[int(first["x-smg-target-worker"])]["url"]
        )
        assert snap["engine_errors"] == 1 and snap["refusals"] == 0
        metrics = httpx.get(f"{gw.url}/metrics", headers=AUTH).text
        assert 'palaestra_gateway_routing_moves_total{reason="engine_error"} 1.0' in metrics, [
            line for line in metrics.splitlines() if "moves" in line
        ]
