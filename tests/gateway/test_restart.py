"""A gateway killed with SIGKILL mid-episode and restarted on the same spool directory and port
continues every open session exactly (the session journal, gateway/sessions/journal.py).

Real processes: `palaestra gateway serve` subprocesses, killed with `kill -9`. The engine is a
deterministic TEST DOUBLE (`ScriptedEngine`, SGLang's /generate shape): its answer is a pure function
of the prompt ids, so the same sessions run without a crash must give exactly the same samples; a
random-weight model would rarely end a turn and would not call tools, so little would bridge. The
last test runs the real embedded engine (`tiny`) through a recording proxy instead, and checks the
tokens against what that engine was sent and sampled.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from palaestra.gateway.cli import gateway_process
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.net import free_port
from tests.support.servers import RecordingProxy, ScriptedEngine, ThreadServer

KEY = {"Authorization": "Bearer k-test"}
ENV = {"PALAESTRA_API_KEY": "k-test", "PALAESTRA_ADMIN_KEY": "k-admin"}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TURNS = 6  # per session; the crash comes after HALF of them
HALF = 3


@pytest.fixture(scope="module")
def scripted(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(input_ids: list[int], index: int) -> list[int]:
        # a deterministic engine: what it says depends on the prompt only
        h = int(hashlib.sha256(json.dumps(input_ids).encode()).hexdigest(), 16)
        if h % 3 == 0:
            text = render_tool_call_text("hermes", "calculator", json.dumps({"expression": f"{h % 97}+1"}))
        else:
            text = f"answer {h % 1000}"
        return tok.encode(text, add_special_tokens=False) + [end]

    double = ScriptedEngine(script, stop_ids={end, tok.convert_tokens_to_ids("<|endoftext|>")})
    with ThreadServer(double.app()) as srv:
        yield double, srv


# -- agents: one per dialect, each a step function over its own history ----------------------
class Agent:
    """An external agent: its session URL and history survive the gateway; `step(i)` is turn i."""

    def __init__(self, client: httpx.Client, base_url: str):
        self.c, self.url = client, base_url

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.c.post(f"{self.url}{path}", json=body, headers=KEY)
        assert r.status_code == 200, r.text
        return r.json()


class ChatAgent(Agent):
    def __init__(self, client: httpx.Client, base_url: str):
        super().__init__(client, base_url)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a calculator agent."},
            {"role": "user", "content": "Add things up."},
        ]

    def step(self, i: int) -> None:
        msg = self.post("/chat/completions", {"model": "tiny", "messages": self.messages, "tools": [CALC]})
        msg = msg["choices"][0]["message"]
        self.messages.append({k: v for k, v in msg.items() if v is not None})
        for call in msg.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(i)})
        if not msg.get("tool_calls"):
            self.messages.append({"role": "user", "content": f"and {i}?"})


class ResponsesAgent(Agent):
    """Continues by `previous_response_id` only: the kept conversation must survive the restart."""

    previous: str | None = None

    def step(self, i: int) -> None:
        body: dict[str, Any] = {"model": "tiny", "input": [{"role": "user", "content": f"more {i}"}]}
        if self.previous:
            body["previous_response_id"] = self.previous
        self.previous = self.post("/responses", body)["id"]


class AnthropicAgent(Agent):
    def __init__(self, client: httpx.Client, base_url: str):
        super().__init__(client, base_url)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello."}]

    def step(self, i: int) -> None:
        m = self.post("/messages", {"model": "tiny", "max_tokens": 64, "messages": self.messages})
        self.messages += [
            {"role": "assistant", "content": m["content"]},
            {"role": "user", "content": f"go on {i}"},
        ]


class CompletionsAgent(Agent):
    prompt = "Count:"

    def step(self, i: int) -> None:
        # ended by max_tokens: a text prompt bridges only on text that holds no stop token
        text = self.post("/completions", {"model": "tiny", "prompt": self.prompt, "max_tokens": 3})
        self.prompt += text["choices"][0]["text"] + f"\n{i}:"


AGENTS: dict[str, Callable[[httpx.Client, str], Agent]] = {
    "chat": ChatAgent,
    "responses": ResponsesAgent,
    "anthropic": AnthropicAgent,
    "completions": CompletionsAgent,
}


def create(c: httpx.Client, url: str, sid: str) -> dict[str, Any]:
    r = c.post(f"{url}/sessions", json={"env": "restart", "task_id": sid, "session_id": sid}, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def reward(c: httpx.Client, url: str, sid: str) -> dict[str, Any]:
    r = c.post(f"{url}/sessions/{sid}/reward", json={"reward": 1.0}, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def all_samples(c: httpx.Client, url: str) -> list[dict[str, Any]]:
    page = c.get(f"{url}/samples", params={"after": 0, "limit": 1000}, headers=KEY).json()
    return page["samples"]


def by_session(samples: list[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for s in samples:
        key = (s["fork_index"], s["tokens"], s["loss_mask"], s["rollout_logprobs"], s["prompt_len"])
        out.setdefault(s["session_id"], []).append(key)
    return out


def test_sigkill_mid_episode_every_open_session_continues_exactly(scripted, tmp_path):
    double, srv = scripted
    names = list(AGENTS)
    # the reference: the same sessions, the same turns, no crash
    with (
        gateway_process("tiny", srv.url, str(tmp_path / "ref"), env=ENV) as gw,
        httpx.Client(timeout=60) as c,
    ):
        for name in ["done", *names]:
            agent = AGENTS.get(name, ChatAgent)(c, create(c, gw.url, name)["base_url"])
            for i in range(TURNS):
                agent.step(i)
            reward(c, gw.url, name)
        reference = by_session(all_samples(c, gw.url))

    spool, port = str(tmp_path / "spool"), free_port()
    double.exchanges.clear()
    c = httpx.Client(timeout=60)
    gw = gateway_process("tiny", srv.url, spool, port=port, env=ENV).start()
    try:
        finished_before = create(c, gw.url, "done")
        done_agent = ChatAgent(c, finished_before["base_url"])
        for i in range(TURNS):
            done_agent.step(i)
        done_answer = reward(c, gw.url, "done")
        agents = {name: AGENTS[name](c, create(c, gw.url, name)["base_url"]) for name in names}
        for agent in agents.values():
            for i in range(HALF):
                agent.step(i)
        before = {name: c.get(f"{gw.url}/sessions/{name}", headers=KEY).json() for name in names}
        os.kill(gw.pid, signal.SIGKILL)
        assert gw.wait(10) == -signal.SIGKILL
    finally:
        gw.stop()
    calls_before = len(double.exchanges)

    gw = gateway_process("tiny", srv.url, spool, port=port, env=ENV).start()  # same port, same directory
    try:
        for name, agent in agents.items():  # the agents go on with their own histories
            after_restart = c.get(f"{gw.url}/sessions/{name}", headers=KEY).json()
            assert after_restart["turns"] == before[name]["turns"], f"{name}: turns not restored exactly"
            for i in range(HALF, TURNS):
                agent.step(i)
            traj = c.get(f"{gw.url}/sessions/{name}", headers=KEY).json()
            assert traj["forks"] == [], f"{name} forked after the restart: {traj['forks']}"
            assert len(traj["turns"]) == TURNS
            assert all(t["parent"] is not None for t in traj["turns"][1:]), f"{name}: a turn did not bridge"
            reward(c, gw.url, name)
        # the first call after the restart carried the exact ids recorded before the crash
        for name in names:
            mine = [e for e in double.exchanges if e.headers["x-smg-routing-key"] == name]
            last_before = before[name]["turns"][-1]
            first_after = [e for e in mine if double.exchanges.index(e) >= calls_before][0]
            head = last_before["prompt_ids"] + last_before["output_ids"]
            assert first_after.body["input_ids"][: len(head)] == head
        # the finished session: not re-emitted, and a repeated reward answers as before
        assert reward(c, gw.url, "done") == done_answer
        samples = all_samples(c, gw.url)
        ids = [s["sample_id"] for s in samples]
        assert len(ids) == len(set(ids)), "a sample was spooled twice"
        assert by_session(samples) == reference, "the samples differ from the run without a crash"
        metrics = c.get(f"{gw.url}/metrics", headers=KEY).text
        assert "palaestra_gateway_open_sessions 0.0" in metrics
    finally:
        gw.stop()
        c.close()


def test_sigkill_during_a_burst_of_turns_tears_nothing_that_was_answered(scripted, tmp_path):
    """Kill -9 while many calls are in flight: every answered turn is in the journal after the
    restart (a write reaches the file before the answer), and a torn record (if any) is dropped."""
    _, srv = scripted
    import concurrent.futures

    spool, port = str(tmp_path / "spool"), free_port()
    gw = gateway_process("tiny", srv.url, spool, port=port, env=ENV).start()
    answered: dict[str, int] = {}
    try:
        with httpx.Client(timeout=60) as c:
            agents = {f"b{i}": ChatAgent(c, create(c, gw.url, f"b{i}")["base_url"]) for i in range(8)}

            def run(name: str) -> None:
                for i in range(40):
                    agents[name].step(i)
                    answered[name] = i + 1

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(run, n) for n in agents]
                while sum(answered.values()) < 40:
                    concurrent.futures.wait(futures, timeout=0.05)
                os.kill(gw.pid, signal.SIGKILL)
                concurrent.futures.wait(futures)
    finally:
        gw.stop()
    gw = gateway_process("tiny", srv.url, spool, port=port, env=ENV).start()
    try:
        with httpx.Client(timeout=60) as c:
            for name, n in answered.items():
                traj = c.get(f"{gw.url}/sessions/{name}", headers=KEY).json()
                assert len(traj["turns"]) >= n and traj["forks"] == []
    finally:
        gw.stop()


# Random weights rarely end a turn; stopping on common letters ends most turns early, so turns bridge.
STOPS = ["e", "a", "o", "i", " "]


@pytest.mark.engine
def test_sigkill_with_the_real_engine_the_sample_is_what_the_engine_sampled(engine, tmp_path):
    rec = RecordingProxy(engine.url)
    spool, port = str(tmp_path / "spool"), free_port()
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0.7, "stop": STOPS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    with ThreadServer(rec.app()) as proxy, httpx.Client(timeout=120) as c:

        def turn(url: str, i: int) -> None:
            r = c.post(f"{url}/s/real/v1/chat/completions", json={**body, "messages": messages}, headers=KEY)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": f"Go on ({i})."})

        gw = gateway_process("tiny", proxy.url, spool, port=port, env=ENV).start()
        try:
            create(c, gw.url, "real")
            for i in range(12):  # until the last turn before the crash ended on a stop: it must bridge
                turn(gw.url, i)
                before = c.get(f"{gw.url}/sessions/real", headers=KEY).json()
                if i >= 1 and before["turns"][-1]["finish_reason"]["type"] == "stop":
                    break
            assert before["turns"][-1]["finish_reason"]["type"] == "stop", "no turn ended on a stop"
            os.kill(gw.pid, signal.SIGKILL)
            gw.wait(10)
        finally:
            gw.stop()
        gw = gateway_process("tiny", proxy.url, spool, port=port, env=ENV).start()
        try:
            crash = len(rec.exchanges)
            for i in range(3):
                turn(gw.url, 100 + i)
            traj = c.get(f"{gw.url}/sessions/real", headers=KEY).json()
            (sample,) = [
                s for s in reward_and_read(c, gw.url, "real") if s["fork_index"] == len(traj["forks"])
            ]
        finally:
            gw.stop()
    n = len(before["turns"])
    assert traj["turns"][:n] == before["turns"]
    assert [t["output_ids"] for t in traj["turns"]] == [e.answer["output_ids"] for e in rec.exchanges]
    assert traj["forks"] == []  # a turn cut by max_tokens is bridged like any other
    # the first call after the restart bridged onto the exact ids of the last one before the crash
    assert (
        traj["turns"][n]["fork_reason"] is None
        and traj["turns"][n]["parent"] == before["turns"][-1]["turn_id"]
    )
    last_before, first_after = rec.exchanges[crash - 1], rec.exchanges[crash]
    head = last_before.body["input_ids"] + last_before.answer["output_ids"]
    assert first_after.body["input_ids"][: len(head)] == head
    last = rec.exchanges[-1]
    assert sample["tokens"] == last.body["input_ids"] + last.answer["output_ids"]


def reward_and_read(c: httpx.Client, url: str, sid: str) -> list[dict[str, Any]]:
    reward(c, url, sid)
    return [s for s in all_samples(c, url) if s["session_id"] == sid]


def test_a_gateway_restarted_with_start_paused_serves_no_turn_until_resumed(scripted, tmp_path):
    """`palaestra train` restarts a gateway that died during an async weight sync with
    `--start-paused` (orchestrator/cluster.Cluster.restart_args): the restarted process keeps every
    open session but serves no generation until /admin/resume; the flag is for that start only."""
    _, srv = scripted
    admin = {"Authorization": "Bearer k-admin"}
    with (
        gateway_process(
            "tiny", srv.url, str(tmp_path / "spool"), env=ENV, extra_args=["--pause-mode", "reject"]
        ) as gw,
        httpx.Client(timeout=60) as c,
    ):
        agent = ChatAgent(c, create(c, gw.url, "held")["base_url"])
        agent.step(0)
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait(timeout=30)
        gw.restart(["--start-paused"])
        r = c.post(
            f"{gw.url}/s/held/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            headers=KEY,
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == "paused", r.text
        assert c.get(f"{gw.url}/sessions/held", headers=KEY).json()["turns"]  # the session is back
        assert c.post(f"{gw.url}/admin/resume", headers=admin).status_code == 200
        agent.step(1)  # served, bridged onto the turn from before the crash
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait(timeout=30)
        gw.restart()  # the flag was for that start only
        agent.step(2)
    assert "--start-paused" not in gw.argv


def test_the_cluster_restarts_its_gateway_paused_only_while_the_run_holds_it_paused():
    from palaestra.config import load_config
    from palaestra.orchestrator.cluster import Box, Cluster

    cluster = Cluster(load_config(None, ["model.student=tiny"]))
    cluster.gateway, cluster.router = Box("gateway", None), Box("router", None)
    cluster.gateway_shards = [cluster.gateway]  # one gateway: it is its only shard
    assert cluster.restart_args(cluster.gateway) == []
    cluster.gateway_paused = True  # set by pause_gateway before its call, cleared by resume_gateway
    assert cluster.restart_args(cluster.gateway) == ["--start-paused"]
    assert cluster.restart_args(cluster.router) == []
    # gateway.shards=2: each shard is a gateway that comes back paused; the front holds no pause
    cluster.gateway_shards = [Box("gateway-shard-0", None), Box("gateway-shard-1", None)]
    assert cluster.restart_args(cluster.gateway_shards[1]) == ["--start-paused"]
    assert cluster.restart_args(cluster.gateway) == []
    assert [b.name for b in cluster.servers] == ["router", "gateway-shard-0", "gateway-shard-1", "gateway"]
