"""The engine's own modules for dense models (engine/native_model.py) against transformers' model
classes: the same tensor names, and bit-identical logits and KV through `ModelRunner` (chunked
prefill, prefill on a cached prefix, batched decode) for each dense architecture the engine serves,
with the options each has (biases, untied head, Qwen3's per-head norms, grouped-query heads);
`auto` falling back to transformers for what the modules do not cover, `native` refusing it in one
line; and a served engine that never imports transformers' modeling code, torch.distributed's
tensor package or torch._dynamo (what made it start ~2x slower).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from palaestra.engine import native_model
from palaestra.engine.model_runner import ModelRunner

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
ARCHS = {
    "llama-biases-untied": (
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    ),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=50000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-head-dim": ("Qwen3Config", dict(head_dim=32, attention_bias=True, tie_word_embeddings=False)),
}


def _random_model_dir(tmp_path, kind: str, **extra):
    """A random transformers model of `kind` (ARCHS) saved as a HF directory; returns (dir, model)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf_dir import save_model

    config_class, options = ARCHS[kind]
    config = getattr(transformers, config_class)(**SMALL, **{**options, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and norms start at 0 and 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / kind
    save_model(model, out)
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _fresh_storage(model):
    """`model` with every parameter in freshly allocated memory, as the native modules' are.

    transformers leaves its tensors where the safetensors file put them (8-byte aligned here);
    torch's CPU matrix-vector kernels take another path for such data, which moves a result by
    ~1e-7. That is where a tensor lives, not what is computed: copied into fresh (64-byte aligned)
    memory, transformers' model computes what the native modules compute, bit for bit."""
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():  # a tied weight once
            p.data = p.data.clone()
    return model


def _same_numerics(native, reference) -> None:
    reference = _fresh_storage(reference)
    a, b = ModelRunner(native, prefill_chunk=5), ModelRunner(reference, prefill_chunk=5)
    assert set(a.named_tensors()) == set(b.named_tensors())
    assert all(torch.equal(t, b.named_tensors()[n]) for n, t in a.named_tensors().items())
    ids = torch.randint(0, a.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    kv_a, logits_a = a.prefill(ids, None, logits_from=0)
    kv_b, logits_b = b.prefill(ids, None, logits_from=0)
    assert torch.equal(logits_a, logits_b)  # bit-identical, not close
    assert all(
        torch.equal(x, y)
        for la, lb in zip(kv_a.layers, kv_b.layers, strict=True)
        for x, y in zip(la, lb, strict=True)
    )
    _, tail_a = a.prefill(ids[9:], kv_a.prefix(9), logits_from=9)
    _, tail_b = b.prefill(ids[9:], kv_b.prefix(9), logits_from=9)
    assert torch.equal(tail_a, tail_b)
    batches = []
    for runner in (a, b):
        batch = runner.new_batch()
        for n in (15, 7, 11):
            batch.add(runner.prefill(ids[:n], None, logits_from=n - 1)[0])
        batches.append(batch)
    for step in range(3):
        tokens = [ids[15 + step], ids[7 + step], ids[11 + step]]
        assert torch.equal(a.decode(batches[0], tokens), b.decode(batches[1], tokens)), step


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_native_modules_compute_what_transformers_computes(tmp_path, kind):
    path, reference = _random_model_dir(tmp_path, kind)
    native = native_model.load(path, reference.config)
    assert isinstance(native, native_model.CausalLM)
    tied = native.lm_head.weight is native.model.embed_tokens.weight
    assert tied == bool(reference.config.tie_word_embeddings)
    _same_numerics(native, reference)


def test_the_tiny_preset_is_served_by_the_native_modules_with_transformers_numerics(tiny_model_dir):
    from palaestra.engine.server import load_model

    native, tok, eos, defaults = load_model(str(tiny_model_dir))
    reference, _, eos_ref, defaults_ref = load_model(str(tiny_model_dir), "transformers")
    assert isinstance(native, native_model.CausalLM) and not isinstance(reference, native_model.CausalLM)
    assert (eos, defaults) == (eos_ref, defaults_ref) and eos
    _same_numerics(native, reference)


@pytest.mark.parametrize(
    ("kind", "extra", "reason"),
    [
        ("llama-tied", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
        ("llama-tied", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ],
)
def test_what_the_modules_do_not_cover_is_refused_before_any_weight_is_read(tmp_path, kind, extra, reason):
    path, reference = _random_model_dir(tmp_path, kind, **extra)
    with pytest.raises(native_model.Unsupported, match=reason):
        native_model.load(path, reference.config)


def test_a_checkpoint_whose_names_do_not_match_the_modules_is_refused(tmp_path):
    """An old checkpoint's rotary buffer, the head of a tied model (which tensor would win is
    transformers' rule to apply), missing projections: refused before a write, so `auto` hands
    the model to transformers."""
    from safetensors.torch import load_file, save_file

    path, reference = _random_model_dir(tmp_path, "qwen2")  # tied
    tensors = load_file(path / "model.safetensors")
    for extra in ("model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.weight"):
        save_file({**tensors, extra: torch.ones(8)}, path / "model.safetensors")
        with pytest.raises(native_model.Unsupported, match=rf"1 unknown \(e.g. \['{re.escape(extra)}'\]"):
            native_model.load(path, reference.config)
    missing = {k: v for k, v in tensors.items() if not k.endswith("o_proj.weight")}
    save_file(missing, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(native_model.Unsupported, match="2 missing"):
        native_model.load(path, reference.config)


def test_auto_falls_back_to_transformers_and_native_refuses_in_one_line(caplog):
    from palaestra.engine.server import load_model
    from palaestra.models import resolve_model

    path = str(resolve_model("tiny-moe"))
    with caplog.at_level("INFO", logger="palaestra.engine"):
        model = load_model(path)[0]
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert "not native: architecture Qwen3MoeForCausalLM" in caplog.text
    with pytest.raises(ValueError, match="--model-impl native cannot serve") as refused:
        load_model(path, "native")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="model_impl must be one of auto, native, transformers"):
        load_model(path, "sglang")


def test_an_engine_of_a_dense_preset_starts_without_transformers_modeling_code(tiny_model_dir):
    """In a fresh interpreter (this one has imported everything): build the engine server, answer
    a /generate, and list what was imported."""
    code = f"""
import json, sys
from fastapi.testclient import TestClient
from palaestra.engine.server import EngineConfig, EngineServer
server = EngineServer(EngineConfig(model_path={str(tiny_model_dir)!r}))
with TestClient(server.app) as client:
    body = {{"text": "hi", "sampling_params": {{"max_new_tokens": 4}}, "return_logprob": True}}
    assert client.post("/generate", json=body).status_code == 200
    used = client.get("/server_info").json()["model_impl_used"]
heavy = ["transformers.modeling_utils", "torch.distributed.tensor", "torch._dynamo", "sympy"]
print(json.dumps({{"used": used, "imported": [m for m in heavy if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"used": "native", "imported": []}, report
