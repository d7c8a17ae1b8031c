"""The embedded engine's /generate against SGLang's contract, on the real `tiny` preset over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.engine  # the module's engine (all but two tests use it)

PROMPT = [5, 77, 301, 12, 999, 45, 8, 1200]


def gen(client, ids=PROMPT, **sampling):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sampling},
        "return_logprob": True,
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_scoring_matches_generation_logprobs(client):
    out = gen(client, temperature=1.0, sampling_seed=11)
    ids = out["output_ids"]
    assert len(ids) == 24 == len(out["meta_info"]["output_token_logprobs"])
    scored = client.post(
        "/generate",
        json={
            "input_ids": PROMPT + ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    ).json()
    inp = scored["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(PROMPT) + len(ids)
    assert inp[0][0] is None and inp[0][1] == PROMPT[0]
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    gen_lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    score_lp = [e[0] for e in inp[len(PROMPT) :]]
    assert [e[1] for e in inp[len(PROMPT) :]] == ids
    delta = max(abs(a - b) for a, b in zip(gen_lp, score_lp, strict=True))
    print(f"max |generation - scoring| logprob = {delta:.2e}")
    assert delta <= 1e-5


def test_logprob_start_len_alignment(client):
    r = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 3,
        },
    ).json()
    inp = r["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == PROMPT[3:]
    assert inp[0][0] is None and all(isinstance(e[0], float) for e in inp[1:])
    full = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    ).json()
    full_lp = [e[0] for e in full["meta_info"]["input_token_logprobs"]]
    assert [e[0] for e in inp[1:]] == pytest.approx(full_lp[4:], abs=1e-5)
    at_end = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(PROMPT),
        },
    ).json()
    assert at_end["meta_info"]["input_token_logprobs"] == []


def test_seeded_requests_reproduce(client):
    a = gen(client, temperature=1.0, sampling_seed=1234)
    b = gen(client, temperature=1.0, sampling_seed=1234)
    c = gen(client, temperature=1.0, sampling_seed=4321)
    assert a["output_ids"] == b["output_ids"]
    # The second request finds the prompt in the prefix cache, so its prefill is a shorter sum in
    # another order: the same tokens, logprobs equal to float32 rounding.
    la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    assert [t[1:] for t in la] == [t[1:] for t in lb]
    assert [t[0] for t in la] == pytest.approx([t[0] for t in lb], abs=1e-5)
    assert a["output_ids"] != c["output_ids"]


def test_batched_and_single_decoding_agree(client):
    prompts = [[7 + i, 100 + 3 * i, 42, 9 * i + 1][: 2 + i % 3] for i in range(8)]
    params = [
        {"max_new_tokens": 20, "ignore_eos": True, "temperature": 0.9, "sampling_seed": 100 + i}
        for i in range(8)
    ]
    single = [
        client.post("/generate", json={"input_ids": p, "sampling_params": s}).json()["output_ids"]
        for p, s in zip(prompts, params, strict=True)
    ]
    batch = client.post("/generate", json={"input_ids": prompts, "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 8
    assert [b["output_ids"] for b in batch] == single
    # the same through concurrent HTTP requests, decoded together by the scheduler
    with cf.ThreadPoolExecutor(8) as pool:
        conc = list(
            pool.map(
                lambda ps: client.post(
                    "/generate", json={"input_ids": ps[0], "sampling_params": ps[1]}
                ).json()["output_ids"],
                zip(prompts, params, strict=True),
            )
        )
    assert conc == single


def test_greedy_and_stop_conditions(client):
    greedy = gen(client, temperature=0.0)
    again = gen(client, temperature=0.0)
    assert greedy["output_ids"] == again["output_ids"]
    stop_id = greedy["output_ids"][5]
    first = greedy["output_ids"].index(stop_id)
    stopped = gen(client, temperature=0.0, stop_token_ids=[stop_id])
    assert stopped["output_ids"] == greedy["output_ids"][: first + 1]  # the matched id is included
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert gen(client, max_new_tokens=3)["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_stop_string_trims_text(client):
    greedy = gen(client, temperature=0.0)
    text = greedy["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.fail(f"pick another stop string; greedy text was {text!r}")
    out = gen(client, temperature=0.0, stop=[stop])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["meta_info"]["finish_reason"]["matched"] == stop
    assert stop not in out["text"] and text.startswith(out["text"])


def test_top_logprobs_and_token_ids_logprob(client):
    out = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 5},
            "return_logprob": True,
            "top_logprobs_num": 4,
            "token_ids_logprob": [3, 4],
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = out["meta_info"]
    assert len(meta["output_top_logprobs"]) == 5
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        vals = [t[0] for t in top]
        assert len(top) == 4 and vals == sorted(vals, reverse=True)
        assert chosen[0] <= vals[0] + 1e-6 and isinstance(chosen[2], str)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT)
    assert [t[1] for t in meta["output_token_ids_logprobs"][0]] == [3, 4]


def test_n_samples_and_text_prompt(client):
    out = client.post(
        "/generate",
        json={
            "text": "Hello world",
            "rid": "nreq",
            "sampling_params": {"max_new_tokens": 4, "n": 3, "sampling_seed": 1},
        },
    ).json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["nreq_0_0", "nreq_0_1", "nreq_0_2"]


def test_prefix_cache_hit_on_next_turn(client):
    turn1 = gen(client, ids=[11, 22, 33, 44, 55, 66, 77, 88, 99, 111], temperature=0.0)
    history = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111] + turn1["output_ids"]
    metrics_before = client.get("/metrics").text
    turn2 = gen(client, ids=history + [5, 6, 7], temperature=0.0)
    assert turn2["meta_info"]["cached_tokens"] == len(history) - 1  # the last sampled token was never fed
    metrics = client.get("/metrics").text
    assert "palaestra_engine_prefix_cache_hit_tokens_total" in metrics
    assert _metric(metrics, "palaestra_engine_prefix_cache_hits_total") > _metric(
        metrics_before, "palaestra_engine_prefix_cache_hits_total"
    )
    # a cache hit must not change the numbers: compare with a cold engine state
    assert client.post("/flush_cache").status_code == 200
    cold = gen(client, ids=history + [5, 6, 7], temperature=0.0)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == turn2["output_ids"]
    hot_lp = [e[0] for e in turn2["meta_info"]["output_token_logprobs"]]
    cold_lp = [e[0] for e in cold["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(hot_lp, cold_lp, strict=True)) < 1e-5


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_streaming_is_cumulative_and_ends_with_done(client):
    events = []
    with client.stream(
        "POST",
        "/generate",
        json={
            "input_ids": PROMPT,
            "stream": True,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6
    for i, chunk in enumerate(chunks):
        assert len(chunk["output_ids"]) == i + 1  # cumulative
        assert len(chunk["meta_info"]["output_token_logprobs"]) == i + 1
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": PROMPT, "bogus": 1}, "unknown field 'bogus'"),
        (
            {"input_ids": PROMPT, "sampling_params": {"temprature": 0.5}},
            "unknown sampling_params field 'temprature'",
        ),
        ({"input_ids": [1, 2, 10**7]}, "out of vocabulary"),
        ({"input_ids": []}, "input_ids"),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1] * 40000}, "context length"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40000}}, "context length"),
        ({"input_ids": PROMPT, "sampling_params": {"structural_tag": "{}"}}, "not supported"),
        ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
        ({"input_ids": PROMPT, "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "only one"),
        ({"input_ids": PROMPT, "lora_path": "x"}, "--enable-lora"),  # served: tests/engine/test_lora.py
        ({"input_ids": PROMPT, "lora_id": "x"}, "not supported"),
        ({"input_ids": PROMPT, "return_routed_experts": True}, "--enable-return-routed-experts"),  # dense
        ({"input_ids": PROMPT, "return_routed_experts": "true"}, "must be a boolean"),
        ({"input_ids": PROMPT, "routed_experts_start_len": -3}, "routed_experts_start_len"),
        ({"input_ids": PROMPT, "logprob_start_len": 99}, "logprob_start_len"),
        ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{}]}, "batch"),
    ],
)
def test_bad_input_is_a_clear_4xx(client, body, needle):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["message"]
    assert client.get("/health").status_code == 200
    assert gen(client, max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_malformed_json_and_wrong_method(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["message"]
    assert client.get("/generate").status_code == 405
    assert gen(client, max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_info_endpoints(client, tiny_model_dir):
    info = client.get("/model_info").json()
    assert info == client.get("/get_model_info").json()
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["is_generation"] is True
    server = client.get("/server_info").json()
    assert server["context_length"] >= 8192 and server["tp_size"] == 1
    assert server["model_path"] == str(tiny_model_dir)
    models = client.get("/v1/models").json()
    assert models["data"][0]["owned_by"] == "sglang"
    assert client.get("/version").status_code == 404  # a /version route would make smg call us vLLM
    assert client.get("/get_weight_version").json()["weight_version"] == info["weight_version"]


def test_runner_matches_transformers_forward(tiny_model_dir):
    """Our cache-managing forward equals `model(input_ids).logits` (prefill, prefix reuse, batched decode)."""
    from transformers import AutoModelForCausalLM

    from palaestra.engine.model_runner import ModelRunner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model, prefill_chunk=5)
    ids = torch.randint(0, 3000, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    kv, logits = runner.prefill(ids, None, logits_from=0)
    assert torch.allclose(logits, ref, atol=1e-4)
    _, tail = runner.prefill(ids[9:], kv.prefix(9), logits_from=9)
    assert torch.allclose(tail, ref[9:], atol=1e-4)
    batch = runner.new_batch()
    for n in (15, 7, 11):
        batch.add(runner.prefill(ids[:n], None, logits_from=n - 1)[0])
    out = runner.decode(batch, [ids[15], ids[7], ids[11]])
    assert torch.allclose(out, ref[[15, 7, 11]], atol=1e-4)
    batch.remove(1)  # the last row moves into row 1
    out = runner.decode(batch, [ids[16], ids[12]])
    assert torch.allclose(out, ref[[16, 12]], atol=1e-4)


def test_generate_via_httpx_async_concurrency(engine):
    """32 concurrent requests complete and are decoded in shared batches (batch-size histogram > 1)."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(base_url=engine.url, timeout=120, trust_env=False) as ac:
            rs = await asyncio.gather(
                *[
                    ac.post(
                        "/generate",
                        json={
                            "input_ids": [3 + i, 50, 60],
                            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                        },
                    )
                    for i in range(32)
                ]
            )
            return rs, (await ac.get("/metrics")).text

    rs, metrics = asyncio.run(run())
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 16 for r in rs)
    big = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("palaestra_engine_decode_batch_size_bucket") and 'le="1.0"' in line
    )
    total = _metric(metrics, "palaestra_engine_decode_batch_size_count")
    assert total > big, "some decode steps should have run more than one sequence"


def test_logprobs_are_fp64_accurate_for_large_logits():
    """The engine's log_softmax keeps fp32 logprobs within ~1e-7 of fp64 where torch's own fp32
    kernel is off by the ULP of log-sum-exp (~2e-6 for logits around 20, as a trained model has)."""
    from palaestra.engine.sampling import log_softmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4096, generator=gen) * 4
    logits[torch.arange(64), torch.randint(0, 4096, (64,), generator=gen)] += 25  # a confident row
    truth = torch.log_softmax(logits.double(), dim=-1)
    likely = truth > -5  # tokens that get sampled (far-tail entries round like their logits do)
    ours = (log_softmax(logits).double() - truth)[likely].abs().max().item()
    torch_fp32 = (torch.log_softmax(logits, dim=-1).double() - truth)[likely].abs().max().item()
    assert ours < 1e-6, ours
    assert ours < torch_fp32 / 3, (ours, torch_fp32)  # the reason this function exists
    masked = logits.clone()
    masked[0, :10] = float("-inf")  # banned tokens stay -inf, the rest still sums to 1
    row = log_softmax(masked)[0]
    assert torch.isinf(row[:10]).all() and abs(row[10:].exp().sum().item() - 1) < 1e-5


def test_constrained_decoding_follows_the_grammar_and_reports_constrained_logprobs(client):
    """json_schema / regex / ebnf through llguidance: the output obeys the grammar even from random
    weights, and each reported logprob is of the masked distribution (higher than unconstrained)."""
    # a schema whose every document is short: random weights would otherwise wander in whitespace
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 22]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    schema["x-guidance"] = {"whitespace_flexible": False}
    tok_url = client.get("/server_info").json()
    assert tok_url  # the engine is up
    for sampling, check in (
        ({"json_schema": json.dumps(schema)}, lambda t: json.loads(t)["n"] in (1, 22)),
        ({"regex": "[0-9]{3}-[a-c]+"}, lambda t: __import__("re").fullmatch("[0-9]{3}-[a-c]+", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ):
        r = client.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 7, **sampling},
                "return_logprob": True,
            },
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (sampling, out["text"])
        assert check(out["text"]), (sampling, out["text"])
        # forced tokens (the only one the grammar allows) have logprob 0 in the constrained distribution
        lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert max(lps) > -1e-4 and all(lp <= 0 for lp in lps)
