"""Partial rollouts (gateway/engine_side/partial.py): a weight update interrupts a turn in flight — the gateway
paused without draining, the engine paused in abort mode, new weights loaded — and the gateway
continues it on the new weights. The client sees one answer; the sample records which version
sampled each token; with greedy sampling the tokens are exactly the old weights' up to the
interruption and then the new weights' continuation of the prompt plus those tokens."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from palaestra.gateway.engine_side import partial
from palaestra.gateway.engine_side.generation import FinishReason, Generation, SamplingParams, VersionSpan
from tests.support.servers import ADMIN_KEY, ENV_KEY, gateway_server

KEY = {"Authorization": f"Bearer {ENV_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
N = 256  # sampled tokens per call; the engine is frozen a few tokens in, so the interruption lands mid-answer


def gen(ids, version, finish=None, spans=()):
    return Generation(
        output_ids=list(ids),
        logprobs=[-0.5] * len(ids),
        top_logprobs=None,
        finish_reason=FinishReason(finish or {"type": "abort", "message": "paused", "status_code": None}),
        weight_version=version,
        weight_versions=list(spans),
    )


def test_continued_joins_tokens_and_spans_and_keeps_the_call_budget():
    first = gen([1, 2, 3], "4")
    assert first.finish_reason.interrupted
    assert not gen([1], "4", {"type": "abort", "status_code": 400}).finish_reason.interrupted
    assert not gen([1], "4", {"type": "length", "length": 1}).finish_reason.interrupted
    sampling = SamplingParams({"min_new_tokens": 5, "n": 2, "temperature": 0}, 10)
    assert list(sampling.to_wire().items()) == [
        ("min_new_tokens", 5),
        ("n", 2),
        ("temperature", 0),
        ("max_new_tokens", 10),
    ]  # SGLang's sampling_params as the dialect set them, the budget last
    rest = sampling.after(3)
    assert rest is not None
    assert list(rest.to_wire().items()) == [("min_new_tokens", 2), ("temperature", 0), ("max_new_tokens", 7)]
    assert SamplingParams({}, 3).after(3) is None
    joined = partial.continued(first, gen([7, 8], "5", {"type": "length", "length": 7}), 10)
    assert joined.output_ids == [1, 2, 3, 7, 8] and len(joined.logprobs) == 5
    assert joined.finish_reason.wire == {"type": "length", "length": 10}
    assert joined.weight_version == "5"
    assert joined.weight_versions == [VersionSpan("4", 0, 3), VersionSpan("5", 3, 5)]
    # interrupted twice: three spans; the same version on both sides of a seam is one span
    twice = partial.continued(joined, gen([9], "6", {"type": "stop", "matched": 0}), 10)
    assert [s.version for s in twice.weight_versions] == ["4", "5", "6"]
    same = partial.continued(gen([1], "4"), gen([2], "4", {"type": "stop", "matched": 0}), 10)
    assert same.weight_versions == [] and same.weight_version == "4"
    spent = partial.continued(first, None, 3)
    assert spent.finish_reason.wire == {"type": "length", "length": 3} and spent.output_ids == [1, 2, 3]


def _generated(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("palaestra_engine_generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("the engine's /metrics has no generation token counter")


def _greedy(client, ids, n):
    """Greedy, exactly `n` tokens, the end-of-text tokens masked as the turn's min_tokens masks them."""
    r = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir, tmp_path_factory):
    original = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(1)
    changed = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if "mlp" in k else v for k, v in original.items()
    }
    out = tmp_path_factory.mktemp("weights-v1")
    save_file(changed, str(out / "model.safetensors"))
    return out


def _interrupt(gw, client, weights, version):
    """What async training does around a sync: the gateway paused without draining, the engine
    paused in abort mode, the new weights loaded, the engine and then the gateway resumed. (The
    engine is already frozen in place by the caller, at a defined point of the answer.)"""
    assert httpx.post(f"{gw.url}/admin/pause", params={"wait": "false"}, headers=ADMIN).json()["paused"]
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    r = client.post("/update_weights_from_disk", json={"model_path": str(weights), "weight_version": version})
    assert r.json()["success"], r.text
    assert client.post("/continue_generation", json={}).status_code == 200
    assert httpx.post(f"{gw.url}/admin/resume", headers=ADMIN).json()["paused"] is False


def _sample(gw, sid):
    r = httpx.post(f"{gw.url}/sessions/{sid}/reward", json={"reward": 1.0}, headers=KEY, timeout=60)
    assert r.status_code == 200, r.text
    after, out = 0, []
    while True:
        page = httpx.get(f"{gw.url}/samples", params={"after": after}, headers=KEY).json()
        out += [s for s in page["samples"] if s["session_id"] == sid]
        if not page["samples"]:
            return out
        after = page["cursor"]


@pytest.mark.engine
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_turn_interrupted_by_a_weight_update_continues_exactly_on_the_new_weights(
    engine, tiny_model_dir, new_weights, tmp_path, stream
):
    client = httpx.Client(base_url=engine.url, timeout=300, trust_env=False)
    version0 = client.get("/model_info").json()["weight_version"]
    try:
        with gateway_server(engine.url, tmp_path / "spool", pause_wait_s=120) as gw:
            s = httpx.post(f"{gw.url}/sessions", json={"env": "partial", "task_id": "t"}, headers=KEY).json()
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": N,
                "min_tokens": N,  # no early end: the answer is exactly N tokens
                "temperature": 0,
                "stream": stream,
            }
            url = f"{s['base_url']}/chat/completions"
            headers = {"Authorization": f"Bearer {s['api_key']}"}

            def call():
                if not stream:
                    return httpx.post(url, json=body, headers=headers, timeout=300).json()
                text = ""
                with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            import json

                            chunk = json.loads(line[6:])
                            for choice in chunk.get("choices", []):
                                text += (choice.get("delta") or {}).get("content") or ""
                return text

            base = _generated(client)
            with cf.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(call)
                deadline = time.monotonic() + 120
                while _generated(client) < base + 8:  # the defined phase: the answer is under way
                    assert time.monotonic() < deadline and not answer.done(), "generation never started"
                    time.sleep(0.005)
                assert (
                    client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
                )  # frozen there
                _interrupt(gw, client, new_weights, "v1")
                result = answer.result(timeout=300)
            (sample,) = _sample(gw, s["session_id"])
        versions = sample["weight_versions"][-N:]
        k = versions.count(version0)
        assert 0 < k < N, f"the interruption must land mid-answer: {k} of {N} tokens before it"
        assert versions == [version0] * k + ["v1"] * (N - k)  # each token's version, in one sample
        output = sample["tokens"][-N:]
        prompt = sample["tokens"][: len(sample["tokens"]) - N]
        if stream:  # the client saw one uninterrupted answer
            assert isinstance(result, str) and len(result) > 0
        else:
            assert result["choices"][0]["finish_reason"] == "length"
            assert result["usage"]["completion_tokens"] == N
        assert len(sample["rollout_logprobs"][-N:]) == N and all(
            lp <= 0 for lp in sample["rollout_logprobs"][-N:]
        )
        # exactness: the new weights' greedy continuation of the prompt plus the kept tokens ...
        assert _greedy(client, prompt + output[:k], N - k) == output[k:]
        # ... after the old weights' greedy first k tokens
        assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": version0}).json()["success"]  # fmt: skip
        assert _greedy(client, prompt, k) == output[:k]
    finally:
        client.post("/continue_generation", json={})
        client.post(
            "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": version0}
        )
        client.close()
