"""Tiny random mixture-of-experts models for the trainer's MoE tests (both routing layouts).

`qwen3_moe`: Qwen3MoeForCausalLM (softmax router, top-2 of 4 experts, norm_topk_prob, QK-norm).
`glm_moe`: Glm4MoeForCausalLM (sigmoid scores chosen with e_score_correction_bias, a shared
expert, the first layer dense, half-rotary RoPE, routed_scaling_factor 2.5).
Weights are scaled up from the default init (fixed seed) so logits and router choices are far
from uniform; the vocabulary is the `tiny` tokenizer's (4096), so its samples fit.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
              tie_word_embeddings=False, rms_norm_eps=1e-6)  # fmt: skip


def build(kind: str, out: Path, seed: int = 0, layers: int = 2, experts: int = 4):
    """Saves a random `kind` ("qwen3_moe" or "glm_moe") model to `out`; returns the HF model."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = {**COMMON, "num_hidden_layers": layers}
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, num_experts=experts, architectures=["Qwen3MoeForCausalLM"])
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "glm_moe":
        cfg = Glm4MoeConfig(**common, n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=1,
                            routed_scaling_factor=2.5, partial_rotary_factor=0.5,
                            architectures=["Glm4MoeForCausalLM"])  # fmt: skip
        model = Glm4MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change some choices
                b.copy_(torch.randn_like(b) * 0.2)
    model.save_pretrained(out)
    return model.eval()
