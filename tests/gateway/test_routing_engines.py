"""Placement on, over real embedded engines behind the real sglang-router: a worker that is removed
or dies moves its sessions, the next turn pays a prefill, and the tokens stay exactly what a
session sees without placement.

Three `palaestra engine serve --model tiny` engines (greedy decoding, so every engine answers a
prompt alike), `palaestra router serve` over them, and two gateways: one with placement off (the
reference) and one with it on. Slow: it starts five servers and waits for the router's health check.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from palaestra.engine.cli import engine_process
from palaestra.engine.router import RouterProcess
from palaestra.gateway.engine_side.placement import PlacementConfig
from tests.support.servers import ADMIN_KEY, gateway_server
from tests.support.sessions import AUTH, new_session, reward, samples

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# each session its own conversation: a session moved to a worker must not find its prompt cached
# there by another session that said the same (greedy decoding answers alike)
USER_TURNS = {
    "removed": ["Count with me: one", "two", "three", "four"],
    "dead": ["Spell with me: a", "b", "c", "d"],
}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    engines = [engine_process("tiny", extra_args=["--num-threads", "1"]) for _ in range(3)]
    for e in engines:
        e.start()
    router = RouterProcess(
        [e.url for e in engines],
        log_level="warn",
        router_options=["--router-health-check-interval-secs", "1"],
    )
    try:
        router.start()
        yield engines, router
    finally:
        router.stop()
        for e in engines:
            e.stop()


def chat(gw, sid: str, messages: list[dict]) -> dict:
    r = httpx.post(
        f"{gw.url}/s/{sid}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
        headers=AUTH,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def play(gw, sid: str, turns: list[str], messages: list[dict] | None = None) -> list[dict]:
    """The agent: each turn adds the answer and its next user message."""
    messages = messages if messages is not None else []
    for text in turns:
        messages.append({"role": "user", "content": text})
        messages.append(chat(gw, sid, messages))
    return messages


def sample_tokens(gw, sid: str) -> list[tuple]:
    reward(gw, sid)
    rows = [s for s in samples(gw)["samples"] if s["session_id"] == sid]
    return [(s["tokens"], s["prompt_len"], s["loss_mask"]) for s in rows]


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_removed_and_dead_workers_move_their_sessions_and_tokens_stay_exact(cluster, tok, tmp_path):
    engines, router = cluster
    # the reference: placement off, nothing disturbed
    with gateway_server(router.url, tmp_path / "ref", tok, placement=PlacementConfig(enabled="off")) as ref:
        expected = {}
        for name in ("removed", "dead"):
            sid = new_session(ref, env="e", group_id=name)["session_id"]
            play(ref, sid, USER_TURNS[name])
            expected[name] = sample_tokens(ref, sid)
    for e in engines:  # the reference's prompts are the test's: a cached copy must not hide a prefill
        assert httpx.post(f"{e.url}/flush_cache", timeout=30).status_code == 200

    record = tmp_path / "routing.jsonl"
    with gateway_server(
        router.url,
        tmp_path / "placed",
        tok,
        placement=PlacementConfig(enabled="on"),
        routing_trace=str(record),
    ) as gw:
        snap = httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()
        assert snap["mode"] == "placement" and len(snap["placement"]["workers"]) == 3
        worker_url = {w["index"]: w["url"] for w in snap["placement"]["workers"]}

        # 1. removed: the router drops the session's worker; the next turn goes elsewhere
        s1 = new_session(gw, env="e", group_id="removed")["session_id"]
        m1 = play(gw, s1, USER_TURNS["removed"][:2])
        before = [r for r in records(record) if r["session"] == s1]
        assert len({r["worker"] for r in before}) == 1
        gone = worker_url[before[-1]["worker"]]
        ids = {w["url"]: w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"]}
        assert httpx.delete(f"{router.url}/workers/{ids[gone]}").status_code == 202
        wait_for(
            lambda: (
                len(httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()["placement"]["workers"]) == 2
            ),
            "the gateway to read the router's new worker list",
        )
        play(gw, s1, USER_TURNS["removed"][2:], m1)
        after = [r for r in records(record) if r["session"] == s1][2:]
        snap = httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()
        urls_now = {w["index"]: w["url"] for w in snap["placement"]["workers"]}
        assert all(urls_now[r["worker"]] != gone for r in after)
        assert after[0]["cached_tokens"] < before[-1]["prompt_tokens"]  # the move paid a prefill
        assert snap["placement"]["moves_by_reason"].get("worker_gone") == 1

        # 2. dead: the session's engine is killed; its next turn is re-placed without an error
        s2 = new_session(gw, env="e", group_id="dead")["session_id"]
        m2 = play(gw, s2, USER_TURNS["dead"][:2])
        first = [r for r in records(record) if r["session"] == s2]
        dead_url = urls_now[first[-1]["worker"]]
        victim = next(e for e in engines if e.url == dead_url)
        victim._proc.kill()  # SIGKILL, as a crashed engine
        victim._proc.wait()
        play(gw, s2, USER_TURNS["dead"][2:3], m2)  # the router either refuses the target or has dropped it
        wait_for(
            lambda: any(
                not w["healthy"] or w["url"] != dead_url
                for w in httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()["placement"]["workers"]
            ),
            "the router's health check to mark the dead worker",
        )
        play(gw, s2, USER_TURNS["dead"][3:], m2)
        later = [r for r in records(record) if r["session"] == s2][2:]
        assert later[0]["cached_tokens"] < first[-1]["prompt_tokens"]  # a prefill on a live engine
        snap = httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()["placement"]
        assert snap["moves"] >= 2

        # the tokens: exactly the reference's
        assert sample_tokens(gw, s1) == expected["removed"]
        assert sample_tokens(gw, s2) == expected["dead"]
