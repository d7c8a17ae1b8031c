"""Sharded gateways (gateway/shards.py): who owns a session, what the front forwards and answers for
the fleet, and two real shards behind a real front, one SIGKILLed mid-episode and restarted.

The front's own rules run against two small aiohttp servers that answer what they were asked
(milliseconds); the fleet test runs `palaestra gateway serve` x2 and `palaestra gateway front` as
subprocesses over the deterministic scripted engine of tests/gateway/test_restart.py (a TEST
DOUBLE), and compares every sample with a single gateway's run of the same sessions.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from aiohttp import web

from palaestra.gateway.shards import GatewayFleet, front_app, labelled_metrics, shard_of, shard_spool
from palaestra.net import free_port
from tests.gateway.test_restart import (
    AGENTS,
    ENV,
    HALF,
    KEY,
    TURNS,
    ChatAgent,
    by_session,
    create,
    reward,
    scripted,  # noqa: F401 (the module fixture, shared)
)


# -- who owns a session -------------------------------------------------------------------------
def test_the_owner_is_a_stable_hash_of_the_session_id_spread_over_the_shards():
    assert shard_of("anything", 1) == 0
    assert shard_of("abc", 2) == shard_of("abc", 2) == 1  # the same in every process (not hash())
    counts = Counter(shard_of(f"s{i}", 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 900, counts
    assert shard_spool("runs/x/spool", 0, 1) == "runs/x/spool"
    assert shard_spool("runs/x/spool/", 1, 2) == "runs/x/spool/shard-1"


def test_metrics_of_every_shard_carry_a_shard_label_under_one_help_line():
    a = '# HELP t_total turns\n# TYPE t_total counter\nt_total{kind="chat"} 3.0\nopen 1.0\n'
    b = '# HELP t_total turns\n# TYPE t_total counter\nt_total{kind="chat"} 4.0\nopen 2.0\n'
    text = labelled_metrics([a, b])
    assert text.count("# HELP t_total") == 1
    assert 't_total{shard="0",kind="chat"} 3.0' in text and 't_total{shard="1",kind="chat"} 4.0' in text
    assert 'open{shard="0"} 1.0' in text and 'open{shard="1"} 2.0' in text


@pytest.mark.parametrize("value", [0, 65, -1, True, "2", 1.5])
def test_gateway_shards_outside_1_to_64_is_refused_naming_the_field(value):
    from palaestra.gateway.options import GatewayOptions

    with pytest.raises(ValueError, match=r"gateway.shards must be an integer from 1 to 64"):
        GatewayOptions(shards=value)
    assert "--shards" not in GatewayOptions(shards=2).serve_flags()  # a run's topology, not a flag


def test_each_shard_gets_its_share_of_the_engine_connections_and_its_own_routing_record():
    from palaestra.gateway.options import GatewayOptions

    one = GatewayOptions(routing_trace="runs/r/routing.jsonl")
    assert one.for_shard(0, 1) is one  # one gateway: its options as given
    flags = one.for_shard(1, 3).serve_flags()
    assert flags[flags.index("--routing-trace") + 1] == "runs/r/routing.shard-1.jsonl"
    assert flags[flags.index("--engine-max-connections") + 1] == "171"  # 512 / 3, rounded up
    assert GatewayOptions(engine_max_connections=1).for_shard(5, 8).engine_max_connections == 1
    assert GatewayOptions().for_shard(0, 2).routing_trace is None
    assert {GatewayOptions(routing_trace="t").for_shard(i, 2).routing_trace for i in (0, 1)} == {
        "t.shard-0",
        "t.shard-1",
    }


@pytest.mark.parametrize("value", [0, -1, 65537, 10**12, True, "512", 1.5, None])
def test_engine_max_connections_outside_1_to_65536_is_refused_naming_the_field(value):
    from palaestra.gateway.options import GatewayOptions

    with pytest.raises(
        ValueError, match=r"gateway.engine_max_connections must be an integer from 1 to 65536"
    ):
        GatewayOptions(engine_max_connections=value)


def test_the_gateway_opens_at_most_engine_max_connections_to_the_engine(tok, tmp_path):
    from palaestra.gateway.app import create_app
    from palaestra.gateway.config import GatewayConfig

    config = GatewayConfig(
        model="tiny",
        engine_url="http://127.0.0.1:9",
        spool_dir=str(tmp_path),
        context_length=4096,
        api_key="k",
        admin_key="a",
        engine_max_connections=7,
    )
    engine = create_app(config, tokenizer=tok).state.service.turns.engine

    async def main() -> None:
        try:
            assert engine.http.max_connections == 7
        finally:
            await engine.close()

    asyncio.run(main())


# -- the front, over two echoing shards -----------------------------------------------------------
def _echo_shard(index: int, cut: list[int] | None = None) -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/long-stream"):  # until the client goes: `cut` records that it saw it
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            try:
                for k in range(500):
                    await out.write(f"data: {k}\n\n".encode())
                    await asyncio.sleep(0.01)
            except (ConnectionResetError, RuntimeError):
                assert cut is not None
                cut.append(index)
            return out
        if request.path.endswith("/stream"):  # an SSE answer in three chunks, with pauses between
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for k in range(3):
                await out.write(f"data: {index}-{k}\n\n".encode())
                await asyncio.sleep(0.01)
            await out.write_eof()
            return out
        if request.path.startswith("/admin/"):
            if request.headers.get("Authorization") != "Bearer admin":
                return web.json_response({"error": "no"}, status=401)
            return web.json_response({"paused": True, "in_flight": index + 1, "drained": index == 0})
        if request.path == "/metrics":
            return web.Response(text=f"# HELP up up\n# TYPE up gauge\nup {index}.0\n")
        return web.json_response(
            {
                "shard": index,
                "path": request.path_qs,
                "body": (await request.read()).decode(),
                "host": request.headers.get("Host"),
            }
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_the_front_sends_each_call_to_its_sessions_shard_and_answers_for_the_fleet():
    async def main() -> None:
        cut: list[int] = []
        shards = [await _serve(_echo_shard(i, cut)) for i in range(2)]
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        runner, url = await _serve(front_app([u for _, u in shards]))
        down_runner, down_url = await _serve(front_app([shards[0][1], dead]))
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                for sid in ("abc", "x1", "x2", "x3"):
                    r = (await c.post(f"/s/{sid}/v1/chat/completions", content=b'{"m": 1}')).json()
                    assert r["shard"] == shard_of(sid, 2) and r["body"] == '{"m": 1}'
                    assert r["host"] == url.removeprefix("http://")  # base_urls name the front
                    assert (await c.get(f"/sessions/{sid}")).json()["shard"] == shard_of(sid, 2)
                    assert (await c.post("/v1/messages", headers={"X-Session-ID": sid})).json()[
                        "shard"
                    ] == shard_of(sid, 2)
                # a new session: the front names its id, the id's shard creates it
                made = (await c.post("/sessions", json={"env": "e"})).json()
                sid = json.loads(made["body"])["session_id"]
                assert made["shard"] == shard_of(sid, 2) and len(sid) == 32
                named = (await c.post("/sessions", json={"session_id": "abc"})).json()
                assert named["shard"] == 1 and json.loads(named["body"]) == {"session_id": "abc"}
                assert (await c.post("/sessions", content=b"[1]")).json()["shard"] == 0  # its error
                # the spool is per shard
                for bad in ({}, {"shard": "2"}, {"shard": "-1"}, {"shard": "1e3"}, {"shard": "9" * 40}):
                    r = await c.get("/samples", params={"after": 0, **bad})
                    assert r.status_code == 400 and "?shard=<0..1>" in r.json()["error"]["message"]
                assert (await c.get("/samples?after=3&shard=1")).json() == {
                    "shard": 1,
                    "path": "/samples?after=3&shard=1",
                    "body": "",
                    "host": url.removeprefix("http://"),
                }
                # SSE comes through unchanged, chunk by chunk
                async with c.stream("GET", "/s/abc/v1/stream") as s:
                    assert s.headers["content-type"] == "text/event-stream"
                    chunks = [chunk async for chunk in s.aiter_bytes()]
                assert b"".join(chunks) == b"data: 1-0\n\ndata: 1-1\n\ndata: 1-2\n\n"
                # a client gone mid-stream: the shard sees its own stream's client go (and, a gateway,
                # drops the engine request) within a few chunks, not after the 500
                async with c.stream("GET", "/s/abc/v1/long-stream") as s:
                    async for _ in s.aiter_bytes():
                        break
                for _ in range(200):
                    if cut:
                        break
                    await asyncio.sleep(0.01)
                assert cut == [1]
                # admin: every shard, summed; an unauthorised call is refused as a shard refuses it
                assert (await c.post("/admin/pause")).status_code == 401
                paused = (await c.post("/admin/pause", headers={"Authorization": "Bearer admin"})).json()
                assert paused["paused"] and paused["in_flight"] == 3 and paused["drained"] is False
                assert len(paused["shards"]) == 2
                metrics = (await c.get("/metrics")).text
                assert 'up{shard="0"} 0.0' in metrics and 'up{shard="1"} 1.0' in metrics
                assert (await c.get("/health")).json() == {"status": "ok", "shards": 2}
            async with httpx.AsyncClient(base_url=down_url, timeout=10) as c:
                sid = next(s for s in (f"d{i}" for i in range(50)) if shard_of(s, 2) == 1)
                r = await c.post(f"/s/{sid}/v1/chat/completions", content=b"{}")
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert "shard 1" in r.json()["error"]["message"]
                # Anthropic's routes get Anthropic's envelope, which its SDKs read (and retry on 5xx)
                for path, headers in (
                    (f"/s/{sid}/v1/messages?beta=true", {}),
                    (f"/s/{sid}/v1/messages/count_tokens", {}),
                    ("/v1/messages", {"X-Session-ID": sid}),
                ):
                    r = await c.post(path, content=b"{}", headers=headers)
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    body = r.json()
                    assert body["type"] == "error" and body["error"]["type"] == "api_error"
                    assert "shard 1" in body["error"]["message"] and set(body["error"]) == {"type", "message"}
                assert (await c.get("/health")).status_code == 503
        finally:
            for r, _ in [*shards, (runner, url), (down_runner, down_url)]:
                await r.cleanup()

    asyncio.run(main())


# -- two real shards, one killed -------------------------------------------------------------------
@pytest.mark.slow  # ~55 s on 2 busy cores: four gateway start-ups and 48 turns
def test_a_killed_shard_restarts_and_its_sessions_continue_exactly_through_the_front(scripted, tmp_path):  # noqa: F811
    """Four dialects' agents through the front, half their turns; the shard owning the most of them
    is SIGKILLed and restarted on its port and spool; they finish, and every sample equals a single
    gateway's run of the same sessions."""
    _, srv = scripted
    names = {f"{kind}-2": kind for kind in AGENTS}  # session id -> its agent's dialect
    owners = {name: shard_of(name, 2) for name in names}
    assert sorted(owners.values()) == [0, 0, 1, 1], owners  # each shard owns two of them
    killed = Counter(owners.values()).most_common(1)[0][0]

    def episode(fleet: GatewayFleet, c: httpx.Client, kill: bool) -> dict:
        agents = {n: AGENTS[kind](c, create(c, fleet.url, n)["base_url"]) for n, kind in names.items()}
        for agent in agents.values():
            assert agent.url.startswith(fleet.url)  # base_urls name the front
            for i in range(HALF):
                agent.step(i)
        if kill:
            fleet.kill(killed)
            fleet.restart(killed)
        for name, agent in agents.items():
            for i in range(HALF, TURNS):
                agent.step(i)
            traj = c.get(f"{fleet.url}/sessions/{name}", headers=KEY).json()
            assert traj["forks"] == [] and len(traj["turns"]) == TURNS, f"{name}: {traj['forks']}"
            reward(c, fleet.url, name)
        samples = []
        for shard in range(len(fleet.shards)):
            params = {"after": 0, "limit": 1000, **({"shard": shard} if len(fleet.shards) > 1 else {})}
            page = c.get(f"{fleet.url}/samples", params=params, headers=KEY).json()
            assert {s["session_id"] for s in page["samples"]} <= {
                n for n in names if len(fleet.shards) == 1 or owners[n] == shard
            }
            samples += page["samples"]
        return by_session(samples)

    with httpx.Client(timeout=60) as c:
        with GatewayFleet("tiny", srv.url, str(tmp_path / "ref"), 1, env=ENV) as one:
            reference = episode(one, c, kill=False)
        with GatewayFleet("tiny", srv.url, str(tmp_path / "spool"), 2, env=ENV) as fleet:
            assert episode(fleet, c, kill=True) == reference, "the samples differ from one gateway's"
            assert (tmp_path / "spool" / f"shard-{killed}").is_dir()
            metrics = c.get(f"{fleet.url}/metrics", headers=KEY).text
            assert 'palaestra_gateway_open_sessions{shard="0"} 0.0' in metrics
            assert 'palaestra_gateway_open_sessions{shard="1"} 0.0' in metrics
            done = ChatAgent(c, create(c, fleet.url, "done")["base_url"])  # new sessions go on too
            done.step(0)
            assert reward(c, fleet.url, "done")["durable"]


def test_a_shards_death_is_counted_as_a_gateway_shard_fault_per_process():
    from palaestra.orchestrator.supervisor import Supervisor

    supervisor = Supervisor(cluster=None, max_restarts=1)
    supervisor._noticed("gateway-shard-1", "generation", "exited with code -9")
    supervisor._noticed("gateway-shard-0", "generation", "exited with code -9")
    assert supervisor.new_counters()["faults/gateway_shard"] == 2.0
    assert supervisor.restarts == {"gateway-shard-1": 1, "gateway-shard-0": 1}  # each its own budget


def test_the_front_answers_a_known_length_whole_with_the_shards_repeated_headers():
    async def shard(request: web.Request) -> web.Response:
        size = 3 << 20 if request.path.endswith("/long") else 70_000  # past the front's whole-answer size
        out = web.Response(body=b"x" * size, content_type="text/plain")  # aiohttp answers HEAD bodiless
        out.headers.add("Set-Cookie", "a=1")
        out.headers.add("Set-Cookie", "b=2")
        seen.append(request.headers.getall("X-Twice", []) + request.headers.getall("Cookie", []))
        return out

    seen: list[list[str]] = []

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", shard)
        runners = [await _serve(app)]
        by_name = runners[0][1].replace("127.0.0.1", "localhost")  # a client's jar keeps no IP's cookies
        runners.append(await _serve(front_app([by_name])))
        try:
            async with httpx.AsyncClient(base_url=runners[1][1], timeout=10) as c:
                headers = [("X-Twice", "1"), ("X-Twice", "2")]
                r = await c.post("/s/abc/v1/chat/completions", content=b"{}", headers=headers)
                assert r.content == b"x" * 70_000 and r.headers["content-length"] == "70000"
                assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
                long = await c.get("/sessions/abc/long")  # streamed through, its length kept
                assert long.content == b"x" * (3 << 20) and long.headers["content-length"] == str(3 << 20)
                c.cookies.clear()  # this client's own jar: the next call sends no cookie of its own
                head = await c.head("/s/abc/v1/chat/completions")
                assert head.content == b"" and head.headers["content-length"] == "70000"
            # repeated headers arrive repeated; the front keeps no cookie of one client for the next
            assert seen == [["1", "2"], [], []]
        finally:
            for r, _ in reversed(runners):
                await r.cleanup()

    asyncio.run(main())


def test_the_shard_bench_puts_2_shards_against_1_gateway_on_paper(capsys):
    from bench.shards import Calm, Row, paper_ceiling, print_on_paper

    one = Calm("1", 2, 512, 4.0, 0.0, [2.0])
    two = Calm("2", 4, 512, 4.0, 0.8, [1.1, 1.4])  # each shard 2.5 ms a turn of its own, split 44/56
    assert (one.ceiling, one.bound) == (500, "the shards")
    assert (two.per_shard_ms, two.ceiling, two.bound) == (2.5, 800, "the shards")
    assert (
        Calm("2", 4, 512, 4.0, 1.0, [0.5, 0.5]).ceiling,
        Calm("2", 4, 512, 4.0, 1.0, [0.5, 0.5]).bound,
    ) == (
        1000,
        "the front",
    )
    lone = Row("1", 64, 256, 1.0, 1.0, 2.0, 2.5, 0.0)
    pair = Row("2", 64, 256, 1.0, 1.0, 2.0, 3.5, 0.5)
    assert paper_ceiling("1", lone) == 400 and paper_ceiling("2", pair) == pytest.approx(2000 / 3)
    print_on_paper([lone, pair], [one, two])
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "2 shards / 1 gateway on paper = 1.60x (below saturation: 800 / 500 turns/s)",
        "2 shards / 1 gateway on paper = 1.67x (from the CPU per turn at 64 sessions)",
    ]
