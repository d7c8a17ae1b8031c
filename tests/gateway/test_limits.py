"""What a gateway may hold is bounded, with back-pressure and a message naming the option: open
sessions, the spool directory's bytes, the stream's backlog, and abandoned sessions (idle timeout).

The engine is a TEST DOUBLE (`ScriptedEngine`, which ends every turn); the gateway is real.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = {"Authorization": "Bearer k-test"}


@pytest.fixture(scope="module")
def scripted(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    double = ScriptedEngine(
        lambda ids, i: tok.encode("fine", add_special_tokens=False) + [end], stop_ids={end}
    )
    with ThreadServer(double.app()) as srv:
        yield double, srv


def gateway(scripted, tok, tmp_path, **options):
    _, srv = scripted
    return gateway_server(srv.url, tmp_path / "spool", tok, context_length=4096, retry_after_s=3, **options)


def create(c, gw) -> httpx.Response:
    return c.post(f"{gw.url}/sessions", json={"env": "lim", "task_id": "t"}, headers=KEY)


def episode(c, gw) -> str:
    """A session with one turn, rewarded: one sample."""
    r = create(c, gw)
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert c.post(f"{gw.url}/s/{sid}/v1/chat/completions", json=body, headers=KEY).status_code == 200
    assert c.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1}, headers=KEY).status_code == 200
    return sid


def metric(c, gw, line: str) -> float:
    for row in c.get(f"{gw.url}/metrics", headers=KEY).text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"no metric {line}")


def refused(r: httpx.Response, code: str, option: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    error = r.json()["error"]
    assert error["code"] == code and option in error["message"], error


def test_open_sessions_limit(scripted, tok, tmp_path):
    with gateway(scripted, tok, tmp_path, max_open_sessions=2) as gw, httpx.Client(timeout=30) as c:
        first = create(c, gw).json()["session_id"]
        create(c, gw)
        refused(create(c, gw), "limit_open_sessions", "max_open_sessions")
        assert metric(c, gw, 'palaestra_gateway_sessions_refused_total{limit="open_sessions"}') == 1
        assert metric(c, gw, "palaestra_gateway_open_sessions") == 2
        c.post(f"{gw.url}/sessions/{first}/reward", json={"reward": 0}, headers=KEY)
        assert create(c, gw).status_code == 200  # a finished session frees its slot


def test_idle_sessions_are_finished_as_aborted_and_busy_ones_are_not(scripted, tok, tmp_path):
    double, _ = scripted
    with (
        gateway(scripted, tok, tmp_path, session_idle_timeout_s=0.4) as gw,
        httpx.Client(timeout=30) as c,
    ):
        idle = create(c, gw).json()["session_id"]
        body = {"messages": [{"role": "user", "content": "hi"}]}
        c.post(f"{gw.url}/s/{idle}/v1/chat/completions", json=body, headers=KEY)
        busy = create(c, gw).json()["session_id"]
        double.delay_s = 1.2  # one call longer than the timeout: in flight, so not idle
        try:
            r = c.post(f"{gw.url}/s/{busy}/v1/chat/completions", json=body, headers=KEY)
        finally:
            double.delay_s = 0.0
        assert r.status_code == 200, r.text
        traj = c.get(f"{gw.url}/sessions/{idle}", headers=KEY).json()
        assert traj["finished"] and traj["status"] == "aborted" and traj["failures"] == ["idle_timeout"]
        (sample,) = c.get(f"{gw.url}/samples", headers=KEY).json()["samples"]
        assert sample["session_id"] == idle and sample["status"] == "aborted"
        assert sample["metrics"]["failure/idle_timeout"] == 1.0
        assert len(c.get(f"{gw.url}/sessions/{busy}", headers=KEY).json()["turns"]) == 1
        deadline = time.monotonic() + 10
        while not c.get(f"{gw.url}/sessions/{busy}", headers=KEY).json()["finished"]:
            assert time.monotonic() < deadline, "the idle session was never finished"
            time.sleep(0.1)
        assert metric(c, gw, "palaestra_gateway_sessions_idle_timeout_total") == 2
        answer = c.post(f"{gw.url}/s/{idle}/v1/chat/completions", json=body, headers=KEY)
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "session_finished"


def test_spool_bytes_budget_and_acknowledged_segments_are_deleted(scripted, tok, tmp_path):
    with (
        gateway(
            scripted,
            tok,
            tmp_path,
            spool_max_bytes=9000,
            spool_segment_bytes=1,  # a segment per finished session
            journal_segment_bytes=1500,
        ) as gw,
        httpx.Client(timeout=30) as c,
    ):
        n = 0
        while (r := create(c, gw)).status_code == 200:
            sid = r.json()["session_id"]
            body = {"messages": [{"role": "user", "content": "hi"}]}
            c.post(f"{gw.url}/s/{sid}/v1/chat/completions", json=body, headers=KEY)
            c.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1}, headers=KEY)
            n += 1
            assert n < 50, "the budget was never reached"
        refused(r, "limit_spool_bytes", "spool_max_bytes")
        used = metric(c, gw, "palaestra_gateway_spool_bytes") + metric(
            c, gw, "palaestra_gateway_journal_bytes"
        )
        assert used >= 9000
        page = c.get(f"{gw.url}/samples", headers=KEY).json()
        assert len(page["samples"]) == n  # nothing was lost on the way
        bad = c.post(f"{gw.url}/samples/ack", json={"cursor": page["last_cursor"] + 1}, headers=KEY)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"
        ack = c.post(f"{gw.url}/samples/ack", json={"cursor": page["last_cursor"]}, headers=KEY).json()
        assert ack["segments_deleted"] == n - 1 and ack["first_cursor"] == page["last_cursor"]
        assert metric(c, gw, "palaestra_gateway_spool_acked_cursor") == page["last_cursor"]
        assert create(c, gw).status_code == 200  # room again
        assert metric(c, gw, 'palaestra_gateway_sessions_refused_total{limit="spool_bytes"}') == 1


def test_backlog_limit_until_the_consumer_reads(scripted, tok, tmp_path):
    with gateway(scripted, tok, tmp_path, max_backlog_samples=2) as gw, httpx.Client(timeout=30) as c:
        episode(c, gw)
        episode(c, gw)
        assert metric(c, gw, "palaestra_gateway_spool_backlog_samples") == 2
        refused(create(c, gw), "limit_backlog", "max_backlog_samples")
        c.get(f"{gw.url}/samples", params={"after": 0, "limit": 1}, headers=KEY)  # one delivered
        assert metric(c, gw, "palaestra_gateway_spool_backlog_samples") == 1
        episode(c, gw)  # admitted: the backlog is 1 again below the limit, then 2
        refused(create(c, gw), "limit_backlog", "max_backlog_samples")
        c.get(f"{gw.url}/samples", params={"after": 1}, headers=KEY)
        assert metric(c, gw, "palaestra_gateway_spool_backlog_samples") == 0
        assert create(c, gw).status_code == 200
        assert metric(c, gw, 'palaestra_gateway_sessions_refused_total{limit="backlog"}') == 2


def test_the_trainers_feed_acknowledges_and_the_spool_deletes(scripted, tok, tmp_path):
    from palaestra.orchestrator.batching import SampleFeed

    with (
        gateway(scripted, tok, tmp_path, spool_segment_bytes=1) as gw,
        httpx.Client(timeout=30) as c,
    ):
        for _ in range(3):
            episode(c, gw)
        feed = SampleFeed(gw.url, "k-test", run_id="other")
        try:
            feed.poll()
            assert feed.cursors == [3]
            feed.ack(feed.cursors)
        finally:
            feed.close()
        assert metric(c, gw, "palaestra_gateway_spool_acked_cursor") == 3
        assert metric(c, gw, "palaestra_gateway_spool_segments_deleted") == 2  # not the one appended to
        assert len(list((tmp_path / "spool").glob("samples-*.jsonl"))) == 1


def test_a_call_waiting_out_a_pause_keeps_its_session_alive(scripted, tok, tmp_path):
    import threading

    admin = {"Authorization": "Bearer k-admin"}
    with (
        # 2 s: the call must reach the gate within the idle timeout of the session's creation (a
        # loaded machine took longer than the 0.3 s this used to be).
        gateway(scripted, tok, tmp_path, session_idle_timeout_s=2.0) as gw,
        httpx.Client(timeout=30) as c,
    ):
        sid = create(c, gw).json()["session_id"]
        c.post(f"{gw.url}/admin/pause", headers=admin)
        answers: list[int] = []
        body = {"messages": [{"role": "user", "content": "hi"}]}
        call = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{gw.url}/s/{sid}/v1/chat/completions", json=body, headers=KEY, timeout=30
                ).status_code
            )
        )
        call.start()
        time.sleep(7.0)  # three idle timeouts and more, waiting at the gate
        assert not c.get(f"{gw.url}/sessions/{sid}", headers=KEY).json()["finished"]
        c.post(f"{gw.url}/admin/resume", headers=admin)
        call.join(30)
        assert answers == [200]


def test_sdk_waits_out_a_limit_and_gives_up_after_limit_wait_s(scripted, tok, tmp_path):
    """`GatewayClient` treats a 429 with Retry-After as back-pressure: it waits as told (without
    using up its failure retries) and gets the session once a slot frees; past `limit_wait_s` it
    raises the gateway's error."""
    import asyncio

    from palaestra.sdk import GatewayClient
    from palaestra.sdk.session import GatewayError as SDKGatewayError

    with gateway(scripted, tok, tmp_path, max_open_sessions=1) as gw, httpx.Client(timeout=30) as c:
        first = create(c, gw).json()["session_id"]

        async def main() -> None:
            client = GatewayClient(gw.url, api_key="k-test", retries=0, limit_wait_s=2.0)
            with pytest.raises(SDKGatewayError, match="max_open_sessions"):  # 3 s > 2 s: gives up
                await client.session("lim", "t")
            client.limit_wait_s = 30.0
            started = time.monotonic()
            waiting = asyncio.create_task(client.session("lim", "t"))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # held back by the limit, not failed
            await asyncio.to_thread(
                c.post, f"{gw.url}/sessions/{first}/reward", json={"reward": 0}, headers=KEY
            )
            session = await waiting
            assert session.session_id != first and time.monotonic() - started >= 2.9  # one Retry-After
            await client.close()

        asyncio.run(main())
