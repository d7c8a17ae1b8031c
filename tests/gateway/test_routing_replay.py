"""Rollout routing replay, the gateway's side: with `return_routed_experts` every engine call asks
the experts it routed, from the first position its turn's sample does not have yet, and each sample
carries the routing of its whole path (`Sample.routed_experts`). Checked against the real embedded
engine serving `tiny-moe` with --enable-return-routed-experts: the sample's routing is, position by
position, what one engine call scoring the sample's tokens from position 0 routes on the same
weights, across bridged turns, a fork, a turn a weight update interrupted and a gateway restart; an
engine that leaves the routing out is refused naming the flag."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import time

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from palaestra.gateway.engine_side.engine_client import EngineClient
from palaestra.gateway.engine_side.generation import FinishReason, Generation, RoutedExperts
from palaestra.gateway.engine_side.partial import continued
from palaestra.gateway.errors import GatewayError
from palaestra.gateway.sessions.trajectory import RoutingError, Turn, linearize
from tests.support.servers import ADMIN_KEY, ENV_KEY, RecordingProxy, ThreadServer, gateway_server

KEY = {"Authorization": f"Bearer {ENV_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FLAG = "--enable-return-routed-experts"
MODEL = "tiny-moe"


# -- units: the records --------------------------------------------------------------------------
def _turn(turn_id, parent, prompt, out, routed):
    return Turn(
        turn_id=turn_id,
        call_id=f"c{turn_id}",
        choice=0,
        parent=parent,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.1] * len(out),
        weight_version="0",
        weight_spans=[],
        finish_reason=FinishReason({"type": "stop", "matched": 1}),
        latency_s=0.0,
        cached_tokens=0,
        kind="completion",
        routed=routed,
    )


def _linearize(leaf):
    return linearize(
        leaf,
        session_id="s-1",
        group_id="g",
        env="e",
        task_id="t",
        fork_index=0,
        reward=1.0,
        metrics={},
        status="completed",
        routing=True,
    )


def test_routing_is_joined_along_the_path_and_a_gap_names_the_session():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 300, size=(12, 2, 2))  # ids past 255: packed as uint16
    root = _turn(1, None, [1, 2, 3, 4], [5, 6], RoutedExperts.of(0, rows[:5]))
    assert root.routed.experts.dtype == np.uint16
    child = _turn(2, root, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], RoutedExperts.of(5, rows[5:11]))
    sample = _linearize(child)
    assert np.array_equal(sample.routing(), rows[:11])  # positions [0, 12 - 1)
    small = RoutedExperts.of(0, rows[:5] % 8)
    assert small.experts.dtype == np.uint8
    gap = _turn(3, root, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], RoutedExperts.of(6, rows[6:11]))
    with pytest.raises(RoutingError, match=r"session s-1: turn 3's routed experts start at position 6"):
        _linearize(gap)
    short = _turn(4, root, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], RoutedExperts.of(5, rows[5:10]))
    with pytest.raises(RoutingError, match=r"cover positions \[0, 10\), the sample needs \[0, 11\)"):
        _linearize(short)
    shape = _turn(5, root, [1, 2, 3, 4, 5, 6, 7, 8], [9], RoutedExperts.of(5, rows[5:8, :1]))
    with pytest.raises(RoutingError, match="rows of shape"):
        _linearize(shape)
    with pytest.raises(RoutingError, match="turn 6 has no routed experts"):
        _linearize(_turn(6, None, [1, 2], [3], None))
    # a continuation's routing is joined on where the interrupted part's ended, or refused
    a = Generation(
        [5], [-0.1], None, FinishReason({"type": "abort"}), "0", routed=RoutedExperts.of(0, rows[:4])
    )
    b = Generation(
        [6], [-0.1], None, FinishReason({"type": "stop"}), "1", routed=RoutedExperts.of(4, rows[4:5])
    )
    assert np.array_equal(continued(a, b, 4).routed.experts, rows[:5])
    with pytest.raises(ValueError, match=r"routing of positions \[0, 4\) then from 3"):
        continued(
            a, Generation([6], [-0.1], None, b.finish_reason, "1", routed=RoutedExperts.of(3, rows[3:4])), 4
        )


def test_journal_form_round_trips():
    rows = np.arange(24).reshape(4, 3, 2)
    r = RoutedExperts.of(7, rows)
    back = RoutedExperts.from_journal(r.to_wire())
    assert back.start == 7 and np.array_equal(back.experts, rows) and back.experts.dtype == np.uint8


def test_wire_routing_is_checked():
    good = base64.b64encode(np.arange(8, dtype="<i4").tobytes()).decode()
    assert RoutedExperts.from_wire(good, 3, 2, 2).experts.shape == (2, 2, 2)
    with pytest.raises(ValueError, match="not rows of 3 layers x 2"):
        RoutedExperts.from_wire(good, 0, 3, 2)
    with pytest.raises(ValueError, match="not base64"):
        RoutedExperts.from_wire("%%%", 0, 2, 2)
    negative = base64.b64encode(np.array([-1, 0, 0, 0], dtype="<i4").tobytes()).decode()
    with pytest.raises(ValueError, match="non-negative"):
        RoutedExperts.from_wire(negative, 0, 2, 2)


def test_the_engines_400_for_routing_names_the_flag():
    client = EngineClient("http://127.0.0.1:9", routed_experts=(2, 2))
    raw = b'{"error": {"message": "return_routed_experts: this server was not started with X"}}'
    with pytest.raises(
        GatewayError, match="--enable-return-routed-experts, or set trainer.routing_replay: off"
    ):
        client._raise_for(400, raw)


def test_an_engine_that_leaves_the_routing_out_is_refused_naming_the_flag(tok, tmp_path):
    from tests.support.servers import ScriptedEngine, TextScript

    script = TextScript(tok)
    engine = ScriptedEngine(script, stop_ids={script.end})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok, model=MODEL, return_routed_experts=True) as gw:
            s = httpx.post(f"{gw.url}/sessions", json={"env": "e", "task_id": "t"}, headers=KEY).json()
            r = httpx.post(
                f"{s['base_url']}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {s['api_key']}"},
                timeout=60,
            )
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert (
        "start the engines with --enable-return-routed-experts, or set trainer.routing_replay: off" in message
    )


# -- against the embedded engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_engine():
    from palaestra.engine.cli import engine_process

    with engine_process(MODEL, extra_args=["--num-threads", "1", FLAG]) as proc:
        yield proc


@pytest.fixture(scope="module")
def proxy(moe_engine):
    rec = RecordingProxy(moe_engine.url)
    with ThreadServer(rec.app()) as srv:
        yield rec, srv


@pytest.fixture(scope="module")
def layout():
    from transformers import AutoConfig

    from palaestra.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(MODEL))
    return config.num_hidden_layers, config.num_experts_per_tok


def _scored(url, tokens, layout) -> np.ndarray:
    """The routing of positions [0, len(tokens)) by one engine call over the whole token list."""
    r = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_routed_experts": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["meta_info"]["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, *layout)


def _samples(gw, sid):
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1.0}, headers=KEY, timeout=60)
    assert r.status_code == 200, r.text
    page = httpx.get(f"{gw.url}/samples", params={"after": 0}, headers=KEY).json()
    from palaestra.sample import Sample

    return [Sample.from_dict(s) for s in page["samples"] if s["session_id"] == sid]


# Random weights rarely end a turn: stopping on common letters ends turns early on a stop string, so
# bridges after a stop are tested as well as those after a cut (max_tokens).
STOPS = ["e", "a", "o", "i", " "]


def _chat(s, messages, max_tokens=16, **extra):
    r = httpx.post(
        f"{s['base_url']}/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stop": STOPS,
            **extra,
        },
        headers={"Authorization": f"Bearer {s['api_key']}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    if extra.get("stream"):  # the answer's events, ended by [DONE]
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        return None
    return r.json()["choices"][0]["message"]


def _assert_matches(sample, url, layout):
    got = sample.routing()
    assert got is not None and len(got) == len(sample.tokens) - 1
    want = _scored(url, sample.tokens, layout)[: len(got)]
    differ = np.nonzero((got != want).any(axis=(1, 2)))[0]
    assert differ.size == 0, f"positions {differ.tolist()} differ"


@pytest.mark.engine
def test_bridged_turns_and_a_fork_carry_the_engines_routing_position_by_position(
    moe_engine, proxy, layout, tok, tmp_path
):
    rec, srv = proxy
    with gateway_server(srv.url, tmp_path / "spool", tok, model=MODEL, return_routed_experts=True) as gw:
        s = httpx.post(f"{gw.url}/sessions", json={"env": "e", "task_id": "t"}, headers=KEY).json()
        first = [{"role": "user", "content": "Count to three."}]
        reply = _chat(s, first)
        start = len(rec.exchanges)
        second = [
            *first,
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": "More."},
        ]
        _chat(s, second, stream=True)
        forked = [{"role": "user", "content": "Something else entirely."}]
        _chat(s, forked)
        bodies = [ex.body for ex in rec.exchanges[start - 1 :]]
        _chat(s, [{"role": "user", "content": "A third start."}])
        # a leaf whose routing does not cover it (staged: its rows moved one position on) is dropped
        staged = gw.app.state.service.sessions.get(s["session_id"]).turns[-1]
        staged.routed = RoutedExperts(staged.routed.start + 1, staged.routed.experts)
        samples = _samples(gw, s["session_id"])
        assert (
            'palaestra_gateway_samples_dropped_total{reason="routing"} 1.0'
            in httpx.get(f"{gw.url}/metrics", headers=KEY).text
        )
        trajectory = httpx.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()
    with gateway_server(srv.url, tmp_path / "spool", tok, model=MODEL, return_routed_experts=True) as gw:
        replayed = httpx.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()
    # the trajectory of the kept samples, live and replayed: each turn's ids read back from its sample
    assert [t["output_ids"] for t in trajectory["turns"]] == [t["output_ids"] for t in replayed["turns"]]
    assert trajectory["sample_ids"] == replayed["sample_ids"] == [x.sample_id for x in samples]
    assert [t["output_ids"] is not None for t in trajectory["turns"]] == [True, True, True, True]
    assert all(b["return_routed_experts"] is True for b in bodies)
    t1 = rec.exchanges[start - 1]
    covered = len(t1.body["input_ids"]) + len(t1.answer["output_ids"]) - 1
    assert bodies[0]["routed_experts_start_len"] == 0
    assert bodies[1]["routed_experts_start_len"] == covered  # the parent's covered end, not asked again
    assert bodies[2]["routed_experts_start_len"] == 0  # a fork starts again
    assert len(samples) == 2 and samples[1].fork_reason == "prefix_changed"
    for sample in samples:
        _assert_matches(sample, moe_engine.url, layout)


@pytest.mark.engine
def test_a_restarted_gateway_replays_the_routing(moe_engine, layout, tok, tmp_path):
    spool = tmp_path / "spool"
    first = [{"role": "user", "content": "Name a colour."}]
    with gateway_server(moe_engine.url, spool, tok, model=MODEL, return_routed_experts=True) as gw:
        s = httpx.post(f"{gw.url}/sessions", json={"env": "e", "task_id": "t"}, headers=KEY).json()
        reply = _chat(s, first)
    with gateway_server(moe_engine.url, spool, tok, model=MODEL, return_routed_experts=True) as gw:
        s["base_url"] = s["base_url"].replace(s["base_url"].split("/s/")[0], gw.url)
        _chat(
            s,
            [*first, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "Why?"}],
        )
        (sample,) = _samples(gw, s["session_id"])
    assert sample.metrics["turns"] == 2.0
    _assert_matches(sample, moe_engine.url, layout)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    from palaestra.models import resolve_model

    original = load_file(str(next(resolve_model(MODEL).glob("*.safetensors"))))
    g = torch.Generator().manual_seed(1)
    changed = {
        k: v + 0.2 * torch.randn(v.shape, generator=g) if "mlp" in k else v for k, v in original.items()
    }
    out = tmp_path_factory.mktemp("moe-weights-v1")
    save_file(changed, str(out / "model.safetensors"))
    return out


def _generated(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("palaestra_engine_generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("the engine's /metrics has no generation token counter")


@pytest.mark.engine
def test_a_turn_a_weight_update_interrupted_carries_the_new_versions_routing(
    moe_engine, layout, new_weights, tok, tmp_path
):
    from palaestra.models import resolve_model

    n = 48
    client = httpx.Client(base_url=moe_engine.url, timeout=300, trust_env=False)
    version0 = client.get("/model_info").json()["weight_version"]
    original = str(resolve_model(MODEL))
    try:
        with gateway_server(
            moe_engine.url, tmp_path / "spool", tok, model=MODEL, return_routed_experts=True, pause_wait_s=120
        ) as gw:
            s = httpx.post(f"{gw.url}/sessions", json={"env": "e", "task_id": "t"}, headers=KEY).json()
            messages = [{"role": "user", "content": "Write a long story."}]
            base = _generated(client)
            with cf.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(_chat, s, messages, n, min_tokens=n, stop=None)
                deadline = time.monotonic() + 120
                while _generated(client) < base + 4:  # under way
                    assert time.monotonic() < deadline and not answer.done(), "generation never started"
                    time.sleep(0.005)
                assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
                assert httpx.post(f"{gw.url}/admin/pause", params={"wait": "false"}, headers=ADMIN).json()[
                    "paused"
                ]
                assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
                r = client.post(
                    "/update_weights_from_disk", json={"model_path": str(new_weights), "weight_version": "v1"}
                )
                assert r.json()["success"], r.text
                assert client.post("/continue_generation", json={}).status_code == 200
                assert httpx.post(f"{gw.url}/admin/resume", headers=ADMIN).json()["paused"] is False
                answer.result(timeout=300)
            (sample,) = _samples(gw, s["session_id"])
        versions = sample.weight_versions[-n:]
        k = versions.count(version0)
        assert 0 < k < n, f"the interruption must land mid-answer: {k} of {n} tokens before it"
        seam = sample.prompt_len + k - 1  # the first position the continuation routed
        got = sample.routing()
        new = _scored(moe_engine.url, sample.tokens, layout)
        assert client.post("/update_weights_from_disk", json={"model_path": original, "weight_version": version0}).json()["success"]  # fmt: skip
        old = _scored(moe_engine.url, sample.tokens, layout)
        assert np.array_equal(got[:seam], old[:seam])
        assert np.array_equal(got[seam:], new[seam : len(got)])
        assert not np.array_equal(
            old[seam : len(got)], new[seam : len(got)]
        )  # the versions route differently
    finally:
        client.post("/continue_generation", json={})
        client.post("/update_weights_from_disk", json={"model_path": original, "weight_version": version0})
        client.close()


@pytest.mark.engine
def test_through_sglang_router_calls_go_to_the_placed_worker_and_carry_the_routing(
    moe_engine, layout, tok, tmp_path
):
    """sglang-router 0.3.2's typed /generate drops `return_routed_experts` (so a call through it comes
    back without routing): with routing on, the gateway reads the router's worker list and posts each
    call to the session's worker itself. Without that bypass this test fails at its first turn."""
    from palaestra.engine.router import RouterProcess

    router = RouterProcess([moe_engine.url], log_level="warn")
    try:
        router.start()
        with gateway_server(
            router.url, tmp_path / "spool", tok, model=MODEL, return_routed_experts=True
        ) as gw:
            s = httpx.post(f"{gw.url}/sessions", json={"env": "e", "task_id": "t"}, headers=KEY).json()
            first = [{"role": "user", "content": "Name a colour."}]
            reply = _chat(s, first)
            _chat(
                s,
                [
                    *first,
                    {"role": "assistant", "content": reply["content"]},
                    {"role": "user", "content": "Why?"},
                ],
                stream=True,
            )
            (sample,) = _samples(gw, s["session_id"])
            snap = httpx.get(f"{gw.url}/admin/routing", headers=ADMIN).json()
    finally:
        router.stop()
    assert snap["mode"] == "direct" and snap["workers_error"] is None, snap
    assert [(w["url"], w["calls"]) for w in snap["placement"]["workers"]] == [(moe_engine.url, 2)]
    assert sample.metrics["turns"] == 2.0
    _assert_matches(sample, moe_engine.url, layout)
