"""The harness sandbox's tunnel (environments/harness/tunnel.py) reaches its own session's routes and
nothing else: not another session's, not the session or admin API, not /metrics, however spelt.

The engine behind the gateway is `ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py);
the gateway, its auth and the tunnel are real.
"""

from __future__ import annotations

import asyncio

import httpx

from palaestra.environments.harness.tunnel import SessionTunnel
from tests.support.servers import ScriptedEngine, TextScript, ThreadServer, gateway_server
from tests.support.sessions import AUTH, new_session


def test_the_tunnel_reaches_only_its_own_session(tok, tmp_path):
    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    with ThreadServer(engine.app()) as eng, gateway_server(eng.url, tmp_path / "spool", tok) as gw:
        mine, other = new_session(gw), new_session(gw)
        sock = str(tmp_path / "tunnel.sock")

        async def run() -> SessionTunnel:
            tunnel = SessionTunnel(gw.url, mine["session_id"], sock)
            await tunnel.start()
            try:
                transport = httpx.AsyncHTTPTransport(uds=sock)
                async with httpx.AsyncClient(transport=transport, base_url="http://harness", timeout=60) as c:
                    ok = await c.post(
                        f"/s/{mine['session_id']}/v1/chat/completions",
                        json={
                            "model": "tiny",
                            "messages": [{"role": "user", "content": "hi"}],
                            "stream": True,
                        },
                        headers={"Authorization": f"Bearer {mine['api_key']}"},
                    )
                    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]"), ok.text
                    sid, oid = mine["session_id"], other["session_id"]
                    for path in (
                        f"/s/{oid}/v1/chat/completions",  # another session
                        f"/s/{sid}/v1/../../{oid}/v1/chat/completions",  # climbing out
                        f"/s/{sid}/v1/%2e%2e/%2e%2e/{oid}/v1/chat/completions",
                        f"/s/{sid}//v1/chat/completions",
                        "/sessions",  # the environment's API
                        f"/sessions/{sid}/reward",
                        "/admin/pause",
                        "/metrics",
                        "/",
                    ):
                        r = await c.post(path, json={}, headers=AUTH)  # even with the environment key
                        assert r.status_code == 403 and "reaches only" in r.text, (
                            path,
                            r.status_code,
                            r.text,
                        )
                # as sent on the wire, without a client normalising the path first
                for raw in (f"/s/{sid}/v1/../../{oid}/v1/models", f"/s/{sid}/v1/%2E%2E/%2E%2E/sessions"):
                    reader, writer = await asyncio.open_unix_connection(sock)
                    writer.write(f"GET {raw} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n".encode())
                    answer = await reader.read()
                    writer.close()
                    assert answer.startswith(b"HTTP/1.1 403"), (raw, answer[:200])
            finally:
                await tunnel.stop()
            return tunnel

        tunnel = asyncio.run(run())
        assert tunnel.forwarded == 1 and sum(tunnel.refused.values()) == 11, tunnel.refused


def test_a_gateway_that_went_away_is_a_502_naming_it_not_a_traceback(tmp_path, caplog):
    """The gateway is gone (nothing listens on its port): the harness's call is answered 502 with
    one line naming the gateway, counted, and aiohttp logs no "Error handling request" traceback."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    sock = str(tmp_path / "tunnel.sock")

    async def run() -> tuple[httpx.Response, SessionTunnel]:
        tunnel = SessionTunnel(gone, "s1", sock)
        await tunnel.start()
        try:
            transport = httpx.AsyncHTTPTransport(uds=sock)
            async with httpx.AsyncClient(transport=transport, base_url="http://harness", timeout=30) as c:
                return await c.post("/s/s1/v1/chat/completions", json={}), tunnel
        finally:
            await tunnel.stop()

    with caplog.at_level("ERROR"):
        r, tunnel = asyncio.run(run())
    assert r.status_code == 502 and r.json()["error"]["message"].startswith(f"gateway unreachable at {gone}")
    assert tunnel.unreachable == 1
    assert not [rec for rec in caplog.records if rec.exc_info], [rec.getMessage() for rec in caplog.records]
