"""LoRA adapters in the embedded engine, over its HTTP API (in process, `tiny` preset).

The adapter math against a forward pass of the merged weights (W + (α/r)·B·A in a transformers
model), a batch mixing two adapters and the base model (each row as it is alone), the prefix
cache kept apart per adapter, and the refusals: another base model (checksum, shapes), an unknown
adapter, a name loaded twice, a server started without LoRA (SGLang's own message). What keeps a
sync's swap short: a load of files resident under another name shares their factors (files
replaced since are read), and the base checksum is computed once per version of the base weights.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fastapi.testclient import TestClient

from palaestra.engine import lora_api
from palaestra.engine.model_runner import ModelRunner
from palaestra.engine.server import EngineConfig, EngineServer
from palaestra.weights_format import base_checksum, read_adapter, serialize_named_tensors, write_adapter

PROMPTS = [[5, 77, 301, 12, 999, 45, 8, 1200], [9, 400, 33, 2048, 17], [100, 200, 300, 400, 500, 600]]
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_config(rank: int = RANK) -> dict:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "target_modules": TARGETS, "bias": "none"}


def random_adapter(model, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """PEFT-named factors for every projection of `model`, large enough to change its outputs."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            o, i = m.weight.shape
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.2
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.2
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    torch.set_num_threads(1)
    s = EngineServer(EngineConfig(model_path=str(tiny_model_dir), enable_lora=True, max_loras_per_batch=2))
    yield s
    s.engine.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with TestClient(server.app) as c:
        yield c


@pytest.fixture(scope="module")
def adapters(server, http, tmp_path_factory):
    """Two adapters loaded as "a" and "b", with the base model's checksum; their factors."""
    model = server.engine.runner.model
    checksum = base_checksum(model.named_parameters())
    made = {}
    for name, seed in (("a", 1), ("b", 2)):
        tensors = random_adapter(model, seed)
        path = write_adapter(tmp_path_factory.mktemp(name) / name, peft_config(), tensors, checksum)
        r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200 and r.json()["success"], r.text
        made[name] = (path, tensors)
    return made


def score(http, ids, lora=None) -> list[float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        body["lora_path"] = lora
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return [e[0] for e in r.json()["meta_info"]["input_token_logprobs"][1:]]


def test_adapter_logprobs_equal_a_forward_of_the_merged_weights(server, http, adapters):
    _, tensors = adapters["a"]
    merged = copy.deepcopy(server.engine.runner.model)
    scale = ALPHA / RANK
    with torch.no_grad():
        for name, m in merged.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in tensors:
                m.weight += scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
    runner = ModelRunner(merged)  # the served modules (engine/native_model.py) have no `forward`
    for ids in PROMPTS:
        lp = torch.log_softmax(runner.prefill(ids, None, logits_from=0)[1], -1)
        want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor(score(http, ids, "a"))
        base = torch.tensor(score(http, ids))
        print(
            f"\nadapter vs merged weights: max |Δ| {(got - want).abs().max():.2e} (vs base {(base - want).abs().max():.2e})"
        )
        assert (got - want).abs().max() <= 1e-5
        assert (base - want).abs().max() > 1e-2  # the adapter does change the model


def test_one_batch_mixes_two_adapters_and_the_base_model(http, adapters):
    sampling = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    def generate(prompts, lora):
        body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True, "lora_path": lora}
        r = http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    batched = generate(PROMPTS, ["a", "b", None])  # one request: admitted and decoded together
    alone = [generate(p, lora) for p, lora in zip(PROMPTS, ["a", "b", None], strict=True)]
    for got, want in zip(batched, alone, strict=True):
        assert got["output_ids"] == want["output_ids"]
        lp = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
        ref = [e[0] for e in want["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp, ref, strict=True)) <= 1e-5
    assert len({tuple(a["output_ids"]) for a in batched}) == 3  # three different policies


def test_prefix_cache_is_kept_apart_per_adapter(http, adapters):
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    first = http.post("/generate", json=body).json()  # the base model's KV of ids is cached now
    longer = {**body, "input_ids": ids + first["output_ids"] + [20, 21]}
    with_a = http.post("/generate", json={**longer, "lora_path": "a"}).json()
    assert with_a["meta_info"]["cached_tokens"] == 0  # the base model's KV is not the adapter's
    again = http.post("/generate", json={**longer, "lora_path": "a"}).json()
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == with_a["output_ids"]
    assert http.post("/generate", json=longer).json()["meta_info"]["cached_tokens"] > 0


def test_refusals_name_the_problem(server, http, adapters, tmp_path):
    model = server.engine.runner.model
    path_a, tensors = adapters["a"]
    # another base model: the checksum in the adapter's metadata is not this engine's
    other = write_adapter(tmp_path / "other", peft_config(), tensors, "0" * 32)
    r = http.post("/load_lora_adapter", json={"lora_name": "other", "lora_path": str(other)})
    assert r.status_code == 400 and "another base model" in r.json()["error_message"]
    # factors of another shape (a PEFT file without checksum is checked by shape)
    wrong = {k: (v[:, :-1] if "lora_A" in k else v) for k, v in tensors.items()}
    bad = write_adapter(tmp_path / "bad", peft_config(), wrong)
    r = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "another base model" in r.json()["error_message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path_a)})
    assert r.status_code == 400 and "already exists" in r.json()["error_message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error_message"]
    r = http.post("/generate", json={"input_ids": PROMPTS[0], "lora_path": "nope"})
    assert r.status_code == 400 and "not loaded: nope" in r.json()["message"] and "'a'" in r.json()["message"]
    assert set(http.get("/server_info").json()["loaded_lora_adapters"]) == {"a", "b"}
    assert read_adapter(path_a).base_checksum == base_checksum(model.named_parameters())
    assert json.loads((path_a / "adapter_config.json").read_text())["r"] == RANK


def test_a_server_without_lora_answers_like_sglang(tiny_model_dir, tmp_path):
    s = EngineServer(EngineConfig(model_path=str(tiny_model_dir)))
    try:
        with TestClient(s.app) as c:
            r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
            assert r.status_code == 400
            assert (
                r.json()["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
            r = c.post("/generate", json={"input_ids": PROMPTS[0], "lora_path": "a"})
            assert r.status_code == 400 and "--enable-lora" in r.json()["message"]
            assert c.get("/server_info").json()["enable_lora"] is False
    finally:
        s.engine.shutdown()


def test_unload_frees_the_name_and_its_cache(http, adapters):
    path, _ = adapters["b"]
    ids = [3, 4, 5, 6, 7, 8]
    http.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "lora_path": "b"}
    )
    r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
    r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 400 and "does not exist" in r.json()["error_message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": str(path)})  # a new load
    assert r.status_code == 200
    again = http.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "lora_path": "b"}
    )
    assert again.json()["meta_info"]["cached_tokens"] == 0  # the unloaded load's KV is gone


def test_the_checksum_samples_tensors_larger_than_float32_counts():
    """An embedding of more than 2**24 values (SmolLM2's is 28 M): its sample positions stay inside."""
    big = torch.arange(2**24 + 4, dtype=torch.int32)
    assert base_checksum([("w", big)]) != base_checksum([("w", big.flip(0))])


def test_a_load_of_resident_files_shares_their_factors_until_the_files_change(
    server, http, adapters, tmp_path, monkeypatch
):
    """The trainer's sync loads each version under its own name before the pause; the load of the
    served name inside the pause then reads nothing (engine/lora_api.load)."""
    reads = []

    def counted_read(path):  # the real read, counted
        reads.append(path)
        return read_adapter(path)

    monkeypatch.setattr(lora_api, "read_adapter", counted_read)
    model = server.engine.runner.model
    path = write_adapter(
        tmp_path / "s", peft_config(), random_adapter(model, 7), base_checksum(model.named_parameters())
    )
    lora = server.engine.lora
    try:
        for name in ("staged", "served"):
            r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 200, r.text
        assert len(reads) == 1
        staged, served = lora.adapters["staged"], lora.adapters["served"]
        assert all(served.weights[m][0] is staged.weights[m][0] for m in staged.weights)
        assert served.uid != staged.uid  # KV cached under one is not the other's
        assert score(http, PROMPTS[0], "served") == score(http, PROMPTS[0], "staged")
        # the directory replaced by a new version (write_adapter renames a new one into place): read
        write_adapter(path, peft_config(), random_adapter(model, 8), base_checksum(model.named_parameters()))
        r = http.post("/load_lora_adapter", json={"lora_name": "newer", "lora_path": str(path)})
        assert r.status_code == 200, r.text
        assert len(reads) == 2
        assert score(http, PROMPTS[0], "newer") != score(http, PROMPTS[0], "served")
    finally:
        for name in ("staged", "served", "newer"):
            http.post("/unload_lora_adapter", json={"lora_name": name})


def test_the_base_checksum_is_computed_once_per_version_of_the_base_weights(tiny_model_dir, tmp_path):
    """Loads reuse the checksum; a weight update makes the next load compute it again, so an
    adapter of the weights before the update is refused after it."""
    s = EngineServer(EngineConfig(model_path=str(tiny_model_dir), enable_lora=True))
    try:
        with TestClient(s.app) as c:
            model, lora = s.engine.runner.model, s.engine.lora
            checksum = base_checksum(model.named_parameters())
            tensors = random_adapter(model, 3)
            path = write_adapter(tmp_path / "a", peft_config(), tensors, checksum)
            r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)})
            assert r.status_code == 200, r.text
            assert lora._checksum == checksum
            lora._checksum = "cached"  # a load now compares with the cached value, not the weights
            r = c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": str(path)})
            assert r.status_code == 400 and "checksum cached" in r.json()["error_message"]
            name, weight = next(iter(model.named_parameters()))
            bumped = [(name, weight.detach() + 0.5)]
            r = c.post("/update_weights_from_tensor",
                       json={"serialized_named_tensors": [serialize_named_tensors(bumped)]})  # fmt: skip
            assert r.status_code == 200, r.text
            assert lora._checksum is None
            r = c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": str(path)})
            assert r.status_code == 400 and "another base model" in r.json()["error_message"]
            assert lora._checksum == base_checksum(model.named_parameters()) != checksum
    finally:
        s.engine.shutdown()
