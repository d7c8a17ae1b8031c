"""The MoE presets (palaestra/models/moe.py): ``tiny-moe`` and ``tiny-glm-moe`` build offline with
`tiny`'s tokenizer, load as their transformers classes, save per-expert Hugging Face names, divide
by EP=2 and PP=2, and route as the recipe says (GLM: chosen with the correction bias).

Builds go into a temporary cache, in which the session's `tiny` build stands (as a link) so that
its tokenizer is not trained again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.models import PRESETS, resolve_model, tiny
from palaestra.models.moe import MOE_PRESETS, MOE_SEED, VERSION


@pytest.fixture(scope="module")
def moe_cache(tmp_path_factory, tiny_model_dir) -> Path:
    cache = tmp_path_factory.mktemp("moe-cache")
    (cache / "models").mkdir()
    (cache / "models" / tiny_model_dir.name).symlink_to(tiny_model_dir)
    return cache


@pytest.fixture(scope="module")
def builds(moe_cache) -> dict[str, Path]:
    return {name: resolve_model(name, cache_dir=moe_cache) for name in MOE_PRESETS}


def test_presets_are_registered():
    assert set(MOE_PRESETS) == {"tiny-moe", "tiny-glm-moe"}
    for name in MOE_PRESETS:
        assert PRESETS[name].recipe == "palaestra.models.moe:resolve"


@pytest.mark.parametrize(
    ("name", "architecture"), [("tiny-moe", "Qwen3MoeForCausalLM"), ("tiny-glm-moe", "Glm4MoeForCausalLM")]
)
def test_build_layout(builds, tiny_model_dir, name, architecture):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    model_dir = builds[name]
    assert model_dir.name == f"{name}-v{VERSION}"
    info = json.loads((model_dir / "palaestra_preset.json").read_text())
    assert (info["name"], info["seed"], info["tokenizer_from"]) == (name, MOE_SEED, f"tiny-v{tiny.VERSION}")
    assert 1_000_000 <= info["parameters"] <= 5_000_000
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == [architecture]
    experts = config.num_experts if name == "tiny-moe" else config.n_routed_experts
    assert (config.num_hidden_layers % 2, experts % 2, config.num_experts_per_tok) == (0, 0, 2)
    assert config.norm_topk_prob and not config.tie_word_embeddings
    # The tokenizer is tiny's, file for file.
    assert (model_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    text = "What is 12345 * 6? <think>café</think>"
    assert (
        AutoTokenizer.from_pretrained(model_dir)(text).input_ids
        == AutoTokenizer.from_pretrained(tiny_model_dir)(text).input_ids
    )
    # On disk, experts have the per-expert names of the real checkpoints (transformers 5 fuses them
    # only in memory), so SGLang and the Megatron conversion read them as they read a Hub model.
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    for expert in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{expert}.{proj}.weight" in names
    assert "lm_head.weight" in names
    saved = json.loads((model_dir / "config.json").read_text())
    for key, value in saved["rope_parameters"].items():
        if key != "rope_type":
            assert saved[key] == value, key  # transformers 4 reads these at the top level


def test_glm_layout_and_router(builds):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builds["tiny-glm-moe"])
    config = model.config
    assert (config.first_k_dense_replace, config.n_shared_experts) == (1, 1)
    assert not hasattr(model.model.layers[0].mlp, "gate")
    gate = model.model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias
    assert bias.abs().min() > 0 and bias.std() > 0.01
    # The bias changes which experts are chosen for some tokens, and never the weights' source.
    hidden = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, chosen = gate(hidden)
    scores = logits.sigmoid()
    unbiased = scores.topk(2, dim=-1).indices
    assert (chosen.sort(-1).values != unbiased.sort(-1).values).any(dim=-1).sum() > 0
    expected = scores.gather(1, chosen)
    expected = expected / expected.sum(-1, keepdim=True) * config.routed_scaling_factor
    torch.testing.assert_close(weights, expected)


def test_builds_are_deterministic(builds, moe_cache, tmp_path):
    import hashlib

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"tiny-v{tiny.VERSION}").symlink_to(moe_cache / "models" / f"tiny-v{tiny.VERSION}")
    second = resolve_model("tiny-moe", cache_dir=tmp_path)
    assert second != builds["tiny-moe"]
    for file in ("model.safetensors", "config.json", "tokenizer.json"):
        digests = {hashlib.sha256((d / file).read_bytes()).hexdigest() for d in (second, builds["tiny-moe"])}
        assert len(digests) == 1, file


def test_unknown_moe_name_is_refused(moe_cache):
    from palaestra.models import moe

    with pytest.raises(ValueError, match="not a MoE preset"):
        moe.resolve("tiny", moe_cache)
