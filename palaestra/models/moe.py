"""The ``tiny-moe`` and ``tiny-glm-moe`` presets: `tiny`'s tokenizer on tiny mixture-of-experts models.

Two random-init models, small enough that a CPU forward takes milliseconds, in the two MoE layouts
an RL run meets in practice:

- ``tiny-moe``: Qwen3-MoE (``Qwen3MoeForCausalLM``). Every layer is sparse: 8 experts, top-2,
  softmax router, the top-2 weights renormalised (``norm_topk_prob``), no shared expert.
- ``tiny-glm-moe``: GLM-4.5 (``Glm4MoeForCausalLM``), DeepSeek-V3's router: sigmoid scores, the
  experts *chosen* by score + ``e_score_correction_bias`` and *weighed* by the score alone, one
  shared expert beside the routed ones, and a dense first layer (``first_k_dense_replace=1``).
  The correction bias is drawn at random (not left at zero), so choosing with and without it
  differ and a reimplementation that forgets it is caught.

Both have 4 layers and 8 experts, so expert parallelism 2 and pipeline parallelism 2 divide them,
untied embeddings (as the real models), and `tiny`'s 4096-token tokenizer and Qwen2.5 chat
template, copied file for file from the `tiny` build. Weights come from a fixed seed; a build
takes seconds. ``demo-moe-teacher``/``demo-moe-student`` are ``tiny-moe`` warm-started by the demo's
SFT recipe (`palaestra.environments.math.warmstart`, configs/moe.yaml).

    palaestra model build tiny-moe
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from palaestra.models.cache import build_once, preset_dir, write_marker
from palaestra.models.hf_dir import save_model

__all__ = ["MOE_PRESETS", "MOE_SEED", "VERSION", "build", "moe_config", "resolve"]

VERSION = 1
"""Bump whenever the recipe changes: the cache directories ``tiny-moe-v<VERSION>`` carry it."""

MOE_SEED = 4321

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "dtype": "float32",
}

MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-moe": {
        "model_type": "qwen3_moe",
        **_COMMON,
        "num_experts": 8,
        "moe_intermediate_size": 128,
        "intermediate_size": 256,  # unused: no layer is dense (`mlp_only_layers` is empty)
        "decoder_sparse_step": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "tiny-glm-moe": {
        "model_type": "glm4_moe",
        **_COMMON,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "intermediate_size": 256,  # the dense first layer's MLP
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,  # GLM-4.5's
        "attention_bias": True,  # GLM-4.5's
        "use_qk_norm": False,  # as GLM-4.5-Air
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layer
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    },
}
"""Each preset's transformers config (besides the vocabulary and special token ids): fixed, since
the trainer's Megatron conversion and its parallel layouts are built against these shapes."""

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def moe_config(name: str, vocab_size: int, eos_ids: list[int], pad_id: int) -> Any:
    """The transformers config of preset `name` for a vocabulary of `vocab_size` (padded) tokens."""
    from transformers import AutoConfig

    fields = dict(MOE_PRESETS[name])
    return AutoConfig.for_model(
        fields.pop("model_type"),
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **fields,
    )


def build(out_dir: Path, name: str, cache_dir: str | Path | None = None, seed: int = MOE_SEED) -> None:
    """Write preset `name` into `out_dir`: the tokenizer files of `tiny` (resolved in `cache_dir`),
    then the model with weights (and, for GLM, correction biases) drawn from `seed`; the caller's
    torch RNG is left untouched."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from palaestra.models import tiny

    tiny_dir = tiny.resolve("tiny", cache_dir)
    for file in _TOKENIZER_FILES:
        if (tiny_dir / file).is_file():
            shutil.copyfile(tiny_dir / file, out_dir / file)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    eos_ids = [tokenizer.convert_tokens_to_ids(tiny.IM_END), tokenizer.convert_tokens_to_ids(tiny.ENDOFTEXT)]
    pad_id = eos_ids[1]
    config = moe_config(name, -(-len(tokenizer) // 64) * 64, eos_ids, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:  # GLM's router: sigmoid scores are ~0.5 ± 0.05, so 0.05 matters
                bias.copy_(torch.randn_like(bias) * 0.05)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_ids, pad_token_id=pad_id)
    save_model(model, out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    tiny_marker = json.loads((tiny_dir / "palaestra_preset.json").read_text())
    write_marker(
        out_dir,
        name,
        VERSION,
        seed=seed,
        parameters=n_params,
        vocab_size=len(tokenizer),
        tokenizer_from=f"tiny-v{tiny_marker['version']}",
    )


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """The preset's directory, built first if it is not in the cache (a `Preset` recipe)."""
    if name not in MOE_PRESETS:
        raise ValueError(f"not a MoE preset: {name!r} (known: {', '.join(MOE_PRESETS)})")
    return build_once(preset_dir(name, VERSION, cache_dir), lambda out: build(out, name, cache_dir))
