"""The zero-work engine's body reading (a test double's, but benches' pairings rest on it): the ids
counted in the raw bytes must be what a full parse counts, on any body, and the rest the same."""

from __future__ import annotations

import json
import random

import orjson
import pytest
from fastapi.testclient import TestClient

from palaestra.testing.zero import make_app, read_body


def _bodies(rng: random.Random):
    for _ in range(300):
        ids = [rng.randrange(0, 300_000) for _ in range(rng.choice([0, 1, 2, 5, 50]))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": rng.randrange(1, 9)}}
        if rng.random() < 0.5:
            body = {"return_logprob": True, **body, "stream": False}
        if rng.random() < 0.2:  # a string that looks like the key, escaped as JSON must write it
            body["note"] = '"input_ids": [1, 2, 3]'
        if rng.random() < 0.2:  # the key nested too, before the top-level one
            body = {"extra": {"input_ids": [7, 8]}, **body}
        yield orjson.dumps(body)
        yield json.dumps(body).encode()  # the stdlib's spaces
        yield json.dumps(body, indent=2).encode()


def test_the_counted_ids_are_the_parsed_ones_on_random_bodies():
    for raw in _bodies(random.Random(7)):
        full = orjson.loads(raw)
        n, rest = read_body(raw)
        assert n == len(full["input_ids"]), raw[:200]
        assert {k: v for k, v in rest.items() if k != "input_ids"} == {
            k: v for k, v in full.items() if k != "input_ids"
        }


def test_bodies_the_count_cannot_read_are_parsed_whole():
    assert read_body(b'{"text": "hi", "input_ids": [1, -2, 3]}')[0] == 3  # a sign: parsed whole
    assert read_body(b'{"text": "hi"}')[0] == 0
    with pytest.raises(orjson.JSONDecodeError):
        read_body(b'{"input_ids": [1, 2')
    with pytest.raises(ValueError):
        read_body(b"[1, 2]")


def test_the_engine_keeps_each_keys_last_body_only_when_asked():
    raw = orjson.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    kept = TestClient(make_app([9, 2], keep_bodies=True))
    answer = kept.post("/generate", content=raw, headers={"X-SMG-Routing-Key": "s1"}).json()
    assert answer["meta_info"]["prompt_tokens"] == 3 and answer["output_ids"] == [9, 2]
    assert kept.get("/last_body", params={"key": "s1"}).content == raw
    assert kept.get("/last_body", params={"key": "s2"}).status_code == 404
    plain = TestClient(make_app([9, 2]))
    plain.post("/generate", content=raw, headers={"X-SMG-Routing-Key": "s1"})
    assert plain.get("/last_body", params={"key": "s1"}).status_code == 404


def test_the_sink_reads_any_body_and_keeps_nothing():
    """`POST /sink` (bench.gateway's paired part: a client's body carried alone) answers {} to any
    body, JSON or not, and keeps none of it as a /generate body."""
    zero = TestClient(make_app([9, 2], keep_bodies=True))
    for body in (b"{}", b"x" * 500_000, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})):
        answer = zero.post("/sink", content=body, headers={"X-SMG-Routing-Key": "s1"})
        assert answer.status_code == 200 and answer.json() == {}
    assert zero.get("/last_body", params={"key": "s1"}).status_code == 404
