"""The embedded engine serving the MoE presets (``tiny-moe``, ``tiny-glm-moe``): greedy generation
against a plain transformers forward, routed experts in SGLang's format against a recomputation
from the router logits transformers reports (cold, from the prefix cache, from a start position),
the per-expert load in /metrics, weight updates under per-expert checkpoint names, and the 400s.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.engine.protocol import RequestError, parse_generate
from palaestra.weights_format import serialize_named_tensors

FLAG = "--enable-return-routed-experts"
PRESETS = ("tiny-moe", "tiny-glm-moe")
PROMPT = [5, 17, 300, 42, 1024, 7, 99, 2048, 13, 640, 11, 12]


@pytest.fixture(scope="module")
def engines():
    """`palaestra engine serve --model <preset> FLAG` for both presets, started side by side."""
    from palaestra.engine.cli import engine_process

    procs = {name: engine_process(name, extra_args=["--num-threads", "1", FLAG]) for name in PRESETS}
    with contextlib.ExitStack() as stack:
        for proc in procs.values():  # stopped even if the other one fails to start
            stack.callback(proc.stop)
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda proc: proc.start(), procs.values()))
        yield {name: proc.url for name, proc in procs.items()}


@pytest.fixture(scope="module", params=PRESETS)
def moe(request, engines):
    """(preset, its transformers model, a client of its engine)."""
    from transformers import AutoModelForCausalLM

    from palaestra.models import resolve_model

    name = request.param
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).eval()
    with httpx.Client(base_url=engines[name], timeout=120, trust_env=False) as client:
        yield name, model, client


def _generate(client, ids, max_new_tokens=6, **fields):
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        **fields,
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _decode_routing(meta, model) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, model.config.num_hidden_layers, model.config.num_experts_per_tok)


@torch.no_grad()
def _reference(model, ids: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Log-probs [len, vocab] and routing [len, layers, top_k] (experts sorted within a row) of
    `ids` by one plain transformers forward: the experts are recomputed from the router logits
    transformers reports, by each router's documented rule, not read from the engine's hooks."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    config = model.config
    routing = np.zeros((len(ids), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int32)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert len(out.router_logits) == len(moe_layers)
    for layer, logits in zip(moe_layers, out.router_logits, strict=True):
        logits = logits.float()
        if config.model_type == "glm4_moe":  # chosen by sigmoid score + correction bias
            scores = logits.sigmoid() + model.model.layers[layer].mlp.gate.e_score_correction_bias
        else:  # softmax, top-k
            scores = logits.softmax(-1)
        routing[:, layer] = scores.topk(config.num_experts_per_tok, dim=-1).indices.sort(-1).values.numpy()
    return out.logits[0].float().log_softmax(-1), routing


def _sorted(routing: np.ndarray) -> np.ndarray:
    return np.sort(routing, axis=-1)


@pytest.mark.engine
def test_greedy_generation_and_routing_match_transformers(moe):
    name, model, client = moe
    answer = _generate(client, PROMPT, return_routed_experts=True)
    meta, out = answer["meta_info"], answer["output_ids"]
    assert len(out) == 6
    logprobs, routing = _reference(model, PROMPT + out)
    for i, (lp, token, _) in enumerate(meta["output_token_logprobs"]):
        position = len(PROMPT) - 1 + i
        assert token == out[i] == int(logprobs[position].argmax())
        assert abs(lp - float(logprobs[position, token])) < 1e-5
    got = _decode_routing(meta, model)
    # SGLang's rows: every position that went through the model, the last sampled token excluded.
    assert got.shape == (len(PROMPT) + len(out) - 1, model.config.num_hidden_layers, 2)
    np.testing.assert_array_equal(_sorted(got), routing[:-1])
    if name == "tiny-glm-moe":  # the dense first layer reports expert 0 in every slot, as SGLang
        assert (got[:, 0] == 0).all() and (got[:, 1:] != 0).any()


@pytest.mark.engine
def test_prefix_cache_hit_routing_equals_a_cold_run(moe):
    _, model, client = moe
    first = _generate(client, PROMPT[::-1], return_routed_experts=True)
    turn = PROMPT[::-1] + first["output_ids"] + [21, 22, 23]
    second = _generate(client, turn, max_new_tokens=3, return_routed_experts=True)
    assert second["meta_info"]["cached_tokens"] > len(PROMPT)
    _, routing = _reference(model, turn + second["output_ids"])
    np.testing.assert_array_equal(_sorted(_decode_routing(second["meta_info"], model)), routing[:-1])
    # From a start position: rows start..end only.
    start = len(PROMPT)
    third = _generate(
        client, turn, max_new_tokens=3, return_routed_experts=True, routed_experts_start_len=start
    )
    assert third["output_ids"] == second["output_ids"]
    np.testing.assert_array_equal(_sorted(_decode_routing(third["meta_info"], model)), routing[start:-1])
    # Scoring (max_new_tokens 0) covers the prompt up to its last position, as SGLang's [start, len - 1).
    scored = _generate(client, turn, max_new_tokens=0, return_routed_experts=True)
    np.testing.assert_array_equal(
        _sorted(_decode_routing(scored["meta_info"], model)), routing[: len(turn) - 1]
    )


@pytest.mark.engine
def test_batched_requests_route_each_sequence(moe):
    _, model, client = moe
    prompts = [PROMPT[:6], PROMPT[3:], [9, 8, 7, 6, 5]]
    r = client.post(
        "/generate",
        json={
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    for ids, answer in zip(prompts, r.json(), strict=True):
        _, routing = _reference(model, ids + answer["output_ids"])
        np.testing.assert_array_equal(_sorted(_decode_routing(answer["meta_info"], model)), routing[:-1])
    plain = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in plain.json()["meta_info"]
    assert client.get("/server_info").json()["enable_return_routed_experts"] is True


@pytest.mark.engine
def test_streaming_answers_routing_in_the_final_chunk(moe):
    _, model, client = moe
    body = {
        "input_ids": PROMPT[2:],
        "stream": True,
        "return_routed_experts": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    _, routing = _reference(model, PROMPT[2:] + chunks[-1]["output_ids"])
    np.testing.assert_array_equal(_sorted(_decode_routing(chunks[-1]["meta_info"], model)), routing[:-1])


def _expert_load(client) -> dict[tuple[int, int], float]:
    text = client.get("/metrics").text
    pattern = r'palaestra_engine_moe_expert_tokens_total\{expert="(\d+)",layer="(\d+)"\} (\S+)'
    return {(int(layer), int(e)): float(v) for e, layer, v in re.findall(pattern, text)}


@pytest.mark.engine
def test_metrics_count_tokens_per_expert(moe):
    _, model, client = moe
    before = _expert_load(client)
    ids = [3000 + i for i in range(9)]  # not a prefix of anything sent before: all of it is forwarded
    answer = _generate(client, ids, max_new_tokens=4, return_routed_experts=True)
    after = _expert_load(client)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert {layer for layer, _ in after} == set(moe_layers)
    routed = _decode_routing(answer["meta_info"], model)
    for layer in moe_layers:
        for expert in range(8):
            delta = after[layer, expert] - before.get((layer, expert), 0.0)
            assert delta == int((routed[:, layer] == expert).sum()), (layer, expert)


@torch.no_grad()
def _set_experts(model, tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert checkpoint tensors into the transformers model's fused expert tensors."""
    params = dict(model.named_parameters())
    for key in [k for k in params if k.endswith("experts.gate_up_proj")]:
        prefix = key.removesuffix("gate_up_proj")
        for e in range(params[key].shape[0]):
            gate, up = tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]
            params[key][e] = torch.cat([gate, up])
            params[f"{prefix}down_proj"][e] = tensors[f"{prefix}{e}.down_proj.weight"]


@pytest.mark.engine
def test_full_weight_update_under_per_expert_names(moe):
    """Per-expert checkpoint names land in transformers 5's fused expert tensors, from a tensor
    payload and from the checkpoint on disk (the round trip restores the outputs exactly)."""
    from safetensors.torch import load_file

    name, model, client = moe
    from palaestra.models import resolve_model

    model_dir = resolve_model(name)
    original = load_file(model_dir / "model.safetensors")
    baseline = _generate(client, PROMPT)
    changed = {key: (tensor * -1.5 if ".mlp.experts." in key else tensor) for key, tensor in original.items()}
    assert any(".mlp.experts.3.down_proj.weight" in key for key in changed)
    r = client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [serialize_named_tensors(list(changed.items()))]},
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    updated = _generate(client, PROMPT)
    _set_experts(model, changed)
    try:
        logprobs, _ = _reference(model, PROMPT + updated["output_ids"])
        for i, (lp, token, _) in enumerate(updated["meta_info"]["output_token_logprobs"]):
            assert abs(lp - float(logprobs[len(PROMPT) - 1 + i, token])) < 1e-5
    finally:
        _set_experts(model, original)
    assert updated["meta_info"]["output_token_logprobs"] != baseline["meta_info"]["output_token_logprobs"]
    r = client.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
    assert r.status_code == 200 and r.json()["success"], r.text
    restored = _generate(client, PROMPT)
    assert restored["output_ids"] == baseline["output_ids"]
    # The baseline came from the prefix cache, the restored run after the update's flush: equal to
    # float32 round-off.
    for (lp, *_), (base, *_) in zip(
        restored["meta_info"]["output_token_logprobs"],
        baseline["meta_info"]["output_token_logprobs"],
        strict=True,
    ):
        assert abs(lp - base) < 1e-5


@pytest.mark.engine
@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"return_routed_experts": "yes"}, "return_routed_experts must be a boolean"),
        ({"return_routed_experts": 1}, "return_routed_experts must be a boolean"),
        ({"return_routed_experts": True, "routed_experts_start_len": -1}, "non-negative integer"),
        ({"return_routed_experts": True, "routed_experts_start_len": 1.5}, "non-negative integer"),
        ({"return_routed_experts": True, "routed_experts_start_len": True}, "non-negative integer"),
        ({"return_routed_experts": True, "routed_experts_start_len": 10**12}, "beyond the prompt"),
        ({"return_routed_experts": True, "routed_experts_start_len": len(PROMPT) + 1}, "beyond the prompt"),
    ],
)
def test_bad_routed_experts_fields_are_400(moe, fields, needle):
    _, _, client = moe
    r = client.post("/generate", json={"input_ids": PROMPT, **fields})
    assert r.status_code == 400, r.text
    assert needle in r.json()["message"]


def test_without_the_flag_a_request_for_routing_is_400(tiny_model_dir):
    """Served without --enable-return-routed-experts (in process), an MoE model refuses the field."""
    from fastapi.testclient import TestClient

    from palaestra.engine.server import EngineConfig, EngineServer
    from palaestra.models import resolve_model

    server = EngineServer(EngineConfig(model_path=str(resolve_model("tiny-moe"))))
    try:
        with TestClient(server.app) as client:
            r = client.post("/generate", json={"input_ids": PROMPT, "return_routed_experts": True})
            assert r.status_code == 400 and FLAG in r.json()["message"], r.text
            ok = client.post("/generate", json={"input_ids": PROMPT, "return_routed_experts": False})
            assert ok.status_code == 200
            assert "palaestra_engine_moe_expert_tokens_total" in client.get("/metrics").text
    finally:
        server.engine.shutdown()


def test_parse_generate_routed_experts_fields():
    def parse(body, unavailable=None):
        return parse_generate(
            {"input_ids": PROMPT, **body},
            tokenize=None,
            vocab_size=4096,
            context_length=4096,
            defaults={},
            routed_experts_unavailable=unavailable,
        )

    spec = parse({"return_routed_experts": True, "routed_experts_start_len": 4}).specs[0]
    assert (spec.return_routed_experts, spec.routed_experts_start_len) == (True, 4)
    spec = parse({"routed_experts_start_len": None}).specs[0]
    assert (spec.return_routed_experts, spec.routed_experts_start_len) == (False, 0)
    assert parse({"return_routed_experts": False}, unavailable="no").specs[0].return_routed_experts is False
    with pytest.raises(RequestError, match="return_routed_experts: not here"):
        parse({"return_routed_experts": True}, unavailable="not here")
    for bad in ("1", [True], {}, 0.0):
        with pytest.raises(RequestError, match="must be a boolean"):
            parse({"return_routed_experts": bad})


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.integers(min_value=-(2**70), max_value=2**70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, database=None)
@given(routed=_JSON, start=_JSON)
def test_routed_experts_fields_fuzzed_parse_as_documented_or_are_a_request_error(routed, start):
    """Any JSON value for either field: the documented meaning, or a RequestError naming the field."""
    body = {"input_ids": PROMPT, "return_routed_experts": routed, "routed_experts_start_len": start}
    try:
        spec = parse_generate(
            body,
            tokenize=None,
            vocab_size=4096,
            context_length=4096,
            defaults={},
            routed_experts_unavailable=None,
        ).specs[0]
    except RequestError as exc:
        assert "return_routed_experts" in str(exc) or "routed_experts_start_len" in str(exc), exc
        ok_routed = isinstance(routed, bool)
        ok_start = start is None or (
            isinstance(start, int) and not isinstance(start, bool) and 0 <= start <= len(PROMPT)
        )
        assert not (ok_routed and ok_start), f"{routed!r}, {start!r} refused: {exc}"
        return
    assert isinstance(routed, bool) and spec.return_routed_experts is routed
    assert spec.routed_experts_start_len == (0 if start is None else start) <= len(PROMPT)
    assert not isinstance(start, bool)


def test_a_shared_load_under_per_expert_names_is_copied(tmp_path):
    """load_format "mmap" (the shm weight sync) of a file under per-expert names, as the trainer
    writes it: those names are views into the fused expert tensors, so the file is copied in (not
    mapped), and the experts change."""
    from safetensors.torch import load_file, save_file

    from palaestra.engine.server import EngineConfig, EngineServer
    from palaestra.models import resolve_model

    model_dir = resolve_model("tiny-moe")
    original = load_file(model_dir / "model.safetensors")
    changed = {key: (tensor * -1.5 if ".mlp.experts." in key else tensor) for key, tensor in original.items()}
    save_file(changed, tmp_path / "model.safetensors")
    server = EngineServer(EngineConfig(model_path=str(model_dir)))
    try:
        assert server.engine.load_weights_from_file(str(tmp_path), share=True) == len(changed)
        tensors = server.engine.runner.named_tensors()
        key = "model.layers.1.mlp.experts.3.down_proj.weight"
        assert torch.equal(tensors[key], changed[key]) and not torch.equal(tensors[key], original[key])
    finally:
        server.engine.shutdown()
