"""The gateway over the real embedded engine: openai SDK (sync, async, stream), LangChain, concurrency,
crash durability and pause/resume under load. A recording proxy between gateway and engine checks that
every sample's tokens are exactly what the engine was sent and sampled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from palaestra.gateway.cli import gateway_process
from palaestra.gateway.sessions.spool import SampleSpool
from tests.support.servers import gateway_server

pytestmark = pytest.mark.engine  # the real embedded engine (all but one test)

KEY = {"Authorization": "Bearer k-test"}


@pytest.fixture(scope="module")
def gateway(proxy, tmp_path_factory):
    rec, srv = proxy
    with gateway_server(srv.url, tmp_path_factory.mktemp("spool"), pause_wait_s=60) as gw:
        yield gw


def session(gw, **kw):
    r = httpx.post(f"{gw.url}/sessions", json={"env": "real", "task_id": "t", **kw}, headers=KEY)
    r.raise_for_status()
    return r.json()


def finish(gw, sid, value=0.5):
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": value}, headers=KEY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def spooled(gw, session_id):
    out, after = [], 0
    while True:
        page = httpx.get(f"{gw.url}/samples", params={"after": after, "limit": 1000}, headers=KEY).json()
        out += [s for s in page["samples"] if s["session_id"] == session_id]
        if not page["samples"]:
            return out
        after = page["cursor"]


def test_openai_sdk_sync_multi_turn_is_exact(gateway, proxy):
    rec, _ = proxy
    s = session(gateway)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    for _ in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=12,
            temperature=0.8,
            stop=["<|im_end|>"],
            logprobs=True,
            top_logprobs=2,
        )
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == len(r.choices[0].logprobs.content)
        assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == s["session_id"]]
    assert len(mine) == 3
    finish(gateway, s["session_id"])
    samples = spooled(gateway, s["session_id"])
    traj = httpx.get(f"{gateway.url}/sessions/{s['session_id']}", headers=KEY).json()
    reasons = [f["reason"] for f in traj["forks"]]
    # random weights rarely end a turn: a turn cut by max_tokens, sent back as it came, is bridged
    assert len(samples) == 1 and reasons == []
    last_sample = max(samples, key=lambda x: x["fork_index"])
    turns = {t["turn_id"]: t for t in traj["turns"]}
    path, t = [], traj["turns"][-1]
    while t is not None:
        path.append(t)
        t = turns.get(t["parent"])
    assert last_sample["tokens"] == mine[-1].body["input_ids"] + mine[-1].answer["output_ids"]
    assert sum(last_sample["loss_mask"]) == sum(len(t["output_ids"]) for t in path)


def test_openai_sdk_async_and_streaming(gateway, proxy):
    rec, _ = proxy
    s = session(gateway)

    async def run():
        client = openai.AsyncOpenAI(base_url=s["base_url"], api_key="k-test")
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=6
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "b"},
            ],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            parts += [c.delta.content or "" for c in chunk.choices]
        return r, "".join(parts), usage

    r, streamed, usage = asyncio.run(run())
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == s["session_id"]]
    assert mine[1].body.get("stream") is True and usage.completion_tokens == len(mine[1].answer["output_ids"])
    traj = httpx.get(f"{gateway.url}/sessions/{s['session_id']}", headers=KEY).json()
    turn = traj["turns"][1]
    assert turn["output_ids"] == mine[1].answer["output_ids"]
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    ids, fr = turn["output_ids"], turn["finish_reason"]
    body = ids[:-1] if fr["type"] == "stop" and isinstance(fr.get("matched"), int) else ids
    assert streamed == tok.decode(body, skip_special_tokens=False)


def test_completions_endpoint_bridges_text_prompts(gateway, proxy):
    rec, _ = proxy
    s = session(gateway)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    # Greedy, so the first answer is the same text every run: a sampled answer that ends inside a
    # multi-byte character decodes to U+FFFD, and that text cannot name the ids it came from.
    first = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, logprobs=1, temperature=0
    )
    assert len(first.choices[0].logprobs.token_logprobs) == first.usage.completion_tokens
    client.completions.create(
        model="tiny", prompt="Once upon a time" + first.choices[0].text + " and then", max_tokens=5
    )
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == s["session_id"]]
    assert (
        mine[1].body["input_ids"][: len(mine[0].body["input_ids"]) + len(mine[0].answer["output_ids"])]
        == mine[0].body["input_ids"] + mine[0].answer["output_ids"]
    )
    assert client.models.list().data[0].id == "tiny"


def test_langchain_chat_openai(gateway):
    from langchain_openai import ChatOpenAI

    s = session(gateway)
    llm = ChatOpenAI(base_url=s["base_url"], api_key="k-test", model="tiny", max_tokens=8, temperature=0.5)
    first = llm.invoke("Hello there")
    second = llm.invoke([("human", "Hello there"), ("ai", first.content), ("human", "and again")])
    assert isinstance(second.content, str)
    assert second.usage_metadata["output_tokens"] > 0
    traj = httpx.get(f"{gateway.url}/sessions/{s['session_id']}", headers=KEY).json()
    assert len(traj["turns"]) == 2


def test_two_hundred_concurrent_sessions_keep_their_own_tokens(gateway, proxy):
    rec, _ = proxy

    async def one(i: int, client: httpx.AsyncClient):
        s = (
            await client.post(f"{gateway.url}/sessions", json={"env": "load", "task_id": str(i)}, headers=KEY)
        ).json()
        marker = f"session number {i} marker"
        msgs = [{"role": "user", "content": marker}]
        for _ in range(2):
            r = await client.post(
                f"{s['base_url']}/chat/completions",
                headers=KEY,
                json={"model": "tiny", "messages": msgs, "max_tokens": 4, "stop": ["<|im_end|>"]},
            )
            assert r.status_code == 200, r.text
            msgs += [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "again"},
            ]
        await client.post(f"{gateway.url}/sessions/{s['session_id']}/reward", json={"reward": i}, headers=KEY)
        return s["session_id"], marker

    async def run():
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            return await asyncio.gather(*[one(i, client) for i in range(200)])

    results = asyncio.run(run())
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    by_session = {}
    after = 0
    while True:
        page = httpx.get(f"{gateway.url}/samples", params={"after": after, "limit": 1000}, headers=KEY).json()
        for smp in page["samples"]:
            by_session.setdefault(smp["session_id"], []).append(smp)
        if not page["samples"]:
            break
        after = page["cursor"]
    for i, (sid, marker) in enumerate(results):
        mine = by_session[sid]
        assert all(smp["reward"] == i for smp in mine)
        for smp in mine:
            text = tok.decode(smp["tokens"])
            assert marker in text and all(f"session number {j} marker" not in text for j in (i - 1, i + 1))
        prompts = [e.body["input_ids"] for e in rec.exchanges if e.headers.get("x-smg-routing-key") == sid]
        assert len(prompts) == 2


def test_pause_and_resume_under_load_loses_nothing(gateway):
    results: list[int] = []
    errors: list[str] = []

    def worker(i: int):
        with httpx.Client(timeout=120, trust_env=False) as c:
            s = c.post(
                f"{gateway.url}/sessions", json={"env": "pause", "task_id": str(i)}, headers=KEY
            ).json()
            for _ in range(4):
                r = c.post(
                    f"{s['base_url']}/chat/completions",
                    headers=KEY,
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": f"w{i}"}],
                        "max_tokens": 8,
                    },
                )
                if r.status_code != 200:
                    errors.append(r.text)
            r = c.post(f"{gateway.url}/sessions/{s['session_id']}/reward", json={"reward": 1}, headers=KEY)
            results.append(len(r.json()["sample_ids"]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    admin = {"Authorization": "Bearer k-admin"}
    paused = httpx.post(
        f"{gateway.url}/admin/pause", params={"wait": "true", "timeout_s": 60}, headers=admin
    ).json()
    assert paused["paused"] and paused["drained"] and paused["in_flight"] == 0
    time.sleep(0.5)
    assert httpx.post(f"{gateway.url}/admin/resume", headers=admin).json()["paused"] is False
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 24 and all(n >= 1 for n in results)


def test_sigkill_keeps_every_acknowledged_sample(engine, tmp_path):
    spool = str(tmp_path / "spool")
    env = {"PALAESTRA_API_KEY": "k-test", "PALAESTRA_ADMIN_KEY": "k-admin"}
    acknowledged = []
    gw = gateway_process("tiny", engine.url, spool, env=env).start()
    try:
        with httpx.Client(timeout=60, trust_env=False) as c:
            for i in range(12):
                s = c.post(f"{gw.url}/sessions", json={"env": "crash", "task_id": str(i)}, headers=KEY).json()
                c.post(
                    f"{s['base_url']}/chat/completions",
                    headers=KEY,
                    json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
                )
                acknowledged += c.post(
                    f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": i}, headers=KEY
                ).json()["sample_ids"]
            # one more session mid-flight, never rewarded: it may be lost, but nothing else may be
            s = c.post(f"{gw.url}/sessions", json={"env": "crash", "task_id": "open"}, headers=KEY).json()
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait(10)
    finally:
        gw.stop()
    gw2 = gateway_process("tiny", engine.url, spool, env=env).start()
    try:
        page = httpx.get(f"{gw2.url}/samples", params={"after": 0, "limit": 1000}, headers=KEY).json()
        assert [x["sample_id"] for x in page["samples"]] == acknowledged
        assert page["cursors"] == list(range(1, len(acknowledged) + 1))
    finally:
        gw2.stop()


def test_spool_recovers_from_a_torn_tail(tmp_path):
    spool = SampleSpool(tmp_path)
    spool.append([{"sample_id": "a", "x": 1}, {"sample_id": "b", "x": 2}])
    spool.close()
    seg = next(tmp_path.glob("samples-*.jsonl"))
    with open(seg, "ab") as f:
        f.write(b'{"cursor": 3, "sample": {"sample_id": "c"')  # died mid-write, never acknowledged
    again = SampleSpool(tmp_path)
    assert [r["sample"]["sample_id"] for r in again.read(0)] == ["a", "b"]
    assert again.append([{"sample_id": "b"}, {"sample_id": "c"}]) == [2, 3]  # dedup by sample_id
    assert [json.loads(line)["cursor"] for line in seg.read_text().splitlines()] == [1, 2, 3]


def _exact(gateway, rec, sid: str) -> None:
    """Every turn sampled exactly the engine's tokens; a turn that ended on a stop bridged the next
    onto its exact prompt + output; the last sample is the last engine call's tokens."""
    mine = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == sid]
    traj = httpx.get(f"{gateway.url}/sessions/{sid}", headers=KEY).json()
    assert [t["output_ids"] for t in traj["turns"]] == [e.answer["output_ids"] for e in mine]
    assert traj["forks"] == []  # a turn cut by max_tokens is bridged too
    bridged = 0
    for prev, cur, turn in zip(mine, mine[1:], traj["turns"][1:], strict=False):
        if turn["fork_reason"] is None:
            head = prev.body["input_ids"] + prev.answer["output_ids"]
            assert cur.body["input_ids"][: len(head)] == head
            bridged += 1
    assert bridged >= 1, "no turn ended on a stop string: nothing was bridged"
    finish(gateway, sid)
    last = max(spooled(gateway, sid), key=lambda x: x["fork_index"])
    assert last["tokens"] == mine[-1].body["input_ids"] + mine[-1].answer["output_ids"]


# Random weights rarely end a turn; stopping on common letters ends most turns on a stop string, so
# the bridges tested are those after a stop as well as those after a cut (max_tokens).
STOPS = ["e", "a", "o", "i", " "]


def test_responses_sdk_multi_turn_stream_and_chain_are_exact(gateway, proxy):
    rec, _ = proxy
    s = session(gateway)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    items: list = [{"role": "user", "content": "Say hi."}]
    more = {"extra_body": {"stop": STOPS}}
    r = client.responses.create(
        model="tiny", instructions="Be brief.", input=items, max_output_tokens=10, **more
    )
    items += [i.model_dump(exclude_none=True) for i in r.output] + [{"role": "user", "content": "More."}]
    with client.responses.stream(
        model="tiny", instructions="Be brief.", input=items, max_output_tokens=10, temperature=0.7, **more
    ) as stream:
        events = list(stream)
    # cut by max_output_tokens (random weights rarely stop) ends in response.incomplete, as upstream
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == streamed.output_text and streamed.usage.output_tokens > 0
    chained = client.responses.create(
        model="tiny",
        instructions="Be brief.",
        previous_response_id=streamed.id,
        input="Once more.",
        max_output_tokens=10,
        **more,
    )
    assert chained.previous_response_id == streamed.id
    _exact(gateway, rec, s["session_id"])


def test_anthropic_sdk_multi_turn_and_stream_are_exact(gateway, proxy):
    import anthropic

    rec, _ = proxy
    s = session(gateway)
    client = anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="k-test")
    msgs: list = [{"role": "user", "content": "Say hi."}]
    m = client.messages.create(
        model="tiny", system="Be brief.", messages=msgs, max_tokens=10, stop_sequences=STOPS
    )
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": "More."},
    ]
    with client.messages.stream(
        model="tiny", system="Be brief.", messages=msgs, max_tokens=10, stop_sequences=STOPS
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text and final.usage.output_tokens > 0
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    m3 = client.messages.create(
        model="tiny", system="Be brief.", messages=msgs, max_tokens=10, stop_sequences=STOPS
    )
    assert m3.usage.input_tokens > final.usage.input_tokens
    _exact(gateway, rec, s["session_id"])


def test_structured_output_is_honoured_and_recorded_exactly(gateway, proxy):
    """response_format json_schema -> SGLang's json_schema -> the embedded engine's grammar: the
    answer parses against the schema even from random weights, and the turn records exactly the
    engine's (constrained) tokens and logprobs."""
    rec, _ = proxy
    s = session(gateway)
    client = openai.OpenAI(base_url=s["base_url"], api_key="k-test")
    schema = {"type": "object", "properties": {"n": {"enum": [1, 22]}}, "required": ["n"]}
    schema["additionalProperties"], schema["x-guidance"] = False, {"whitespace_flexible": False}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert json.loads(r.choices[0].message.content)["n"] in (1, 22)
    (mine,) = [e for e in rec.exchanges if e.headers.get("x-smg-routing-key") == s["session_id"]]
    assert json.loads(mine.body["sampling_params"]["json_schema"]) == schema
    turn = httpx.get(f"{gateway.url}/sessions/{s['session_id']}", headers=KEY).json()["turns"][0]
    assert turn["output_ids"] == mine.answer["output_ids"]
    assert turn["output_logprobs"] == [e[0] for e in mine.answer["meta_info"]["output_token_logprobs"]]
