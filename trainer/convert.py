"""HF ⇄ Megatron weight conversion for Llama-family models (Llama, Mistral, Qwen2, Qwen3).

Pure functions over state dicts of full (unsharded) tensors; nothing here needs torch.distributed.
Names on the Megatron side are those of `GPTModel` built with `get_gpt_layer_local_spec()`:

=====================================================  ============================================
HF                                                     Megatron
=====================================================  ============================================
model.embed_tokens.weight                              embedding.word_embeddings.weight
model.layers.{i}.input_layernorm.weight                decoder.layers.{i}.input_layernorm.weight
model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}  decoder.layers.{i}.self_attention.linear_qkv.*
                                                       (fused; per query group: its q heads, then
                                                       its k head, then its v head)
model.layers.{i}.self_attn.{q,k}_norm.weight (Qwen3)   decoder.layers.{i}.self_attention.{q,k}_layernorm.weight
model.layers.{i}.self_attn.o_proj.weight               decoder.layers.{i}.self_attention.linear_proj.weight
model.layers.{i}.post_attention_layernorm.weight       decoder.layers.{i}.pre_mlp_layernorm.weight
model.layers.{i}.mlp.{gate,up}_proj.weight             decoder.layers.{i}.mlp.linear_fc1.weight (gate rows, then up)
model.layers.{i}.mlp.down_proj.weight                  decoder.layers.{i}.mlp.linear_fc2.weight
model.norm.weight                                      decoder.final_layernorm.weight
lm_head.weight (untied models only)                    output_layer.weight
=====================================================  ============================================

With tensor parallelism each rank holds a slice of some of these tensors; `tp_shard` /
`tp_unshard` cut and join them the way Megatron's local spec lays them out.

Tied embeddings: Megatron's output layer reads the embedding weight itself, and HF's
`named_parameters()` lists only ``embed_tokens`` — so neither side carries ``lm_head.weight``.

The fused QKV layout is Megatron's `SelfAttention.get_query_key_value_tensors`: rows are grouped by
KV head (query group) g = 0..G-1, each group holding its R = heads/G query heads, then its key
head, then its value head (``[G, (R + 2) * head_dim, hidden]``). HF query head h uses KV head
h // R (`repeat_kv`), the same grouping. Every step is a view, a slice or a concatenation, so the
round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HFArchitecture", "hf_to_megatron", "megatron_to_hf", "tp_shard", "tp_unshard"]

_SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class HFArchitecture:
    """The facts about a HF config that the Megatron model and the conversion depend on."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: Any) -> HFArchitecture:
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        family = _SUPPORTED.get(arch)
        if family is None:
            raise ValueError(f"the trainer converts {', '.join(_SUPPORTED)}; this model is {arch!r}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"only SwiGLU (hidden_act silu) is supported, got {cfg.hidden_act!r}")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = (
            rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        )
        if rope_type not in (None, "default"):
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported by the trainer's conversion")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta if theta is not None else getattr(cfg, "rope_theta", 10000.0)
        if getattr(cfg, "use_sliding_window", False) or (
            family == "llama" and getattr(cfg, "sliding_window", None)
        ):
            raise ValueError("sliding-window attention is not supported")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        qkv_bias = family == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("MLP biases are not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family == "qwen3",
        )


def _fuse_qkv(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, r, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    fused = torch.cat([q.reshape(g, r * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (r + 2) * d, *rest)


def _split_qkv(arch: HFArchitecture, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, r, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (r + 2) * d, *rest)
    q, k, v = torch.split(grouped, [r * d, d, d], dim=1)
    return (
        q.reshape(g * r * d, *rest).clone(),
        k.reshape(g * d, *rest).clone(),
        v.reshape(g * d, *rest).clone(),
    )


def _take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return state.pop(name)
    except KeyError:
        raise KeyError(f"missing tensor {name!r}") from None


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], arch: HFArchitecture) -> dict[str, torch.Tensor]:
    """HF-named tensors of a whole model -> Megatron `GPTModel` (local spec) names.

    Raises on a missing tensor and on tensors it does not know (so a silent partial load cannot
    happen). ``lm_head.weight`` of a tied model is accepted only if it equals the embedding.
    """
    src = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = _take(src, "model.embed_tokens.weight")
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = _take(src, h + "input_layernorm.weight")
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            arch,
            _take(src, a + "q_proj.weight"),
            _take(src, a + "k_proj.weight"),
            _take(src, a + "v_proj.weight"),
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                arch,
                _take(src, a + "q_proj.bias"),
                _take(src, a + "k_proj.bias"),
                _take(src, a + "v_proj.bias"),
            )
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = _take(src, a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = _take(src, a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = _take(src, a + "o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = _take(src, h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(src, h + "mlp.gate_proj.weight"), _take(src, h + "mlp.up_proj.weight")], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = _take(src, h + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = _take(src, "model.norm.weight")
    if arch.tie_word_embeddings:
        head = src.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, out["embedding.word_embeddings.weight"]):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from embed_tokens")
    else:
        out["output_layer.weight"] = _take(src, "lm_head.weight")
    src = {k: v for k, v in src.items() if not k.endswith("rotary_emb.inv_freq")}
    if src:
        raise KeyError(f"unexpected HF tensors: {sorted(src)[:8]}")
    return out


def megatron_to_hf(mg_state: Mapping[str, torch.Tensor], arch: HFArchitecture) -> dict[str, torch.Tensor]:
    """Megatron `GPTModel` (local spec) tensors of a whole model -> HF names (the inverse)."""
    src = {k: v for k, v in mg_state.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = _take(src, "embedding.word_embeddings.weight")
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = _take(src, m + "input_layernorm.weight")
        a = h + "self_attn."
        q, k, v = _split_qkv(arch, _take(src, m + "self_attention.linear_qkv.weight"))
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            q, k, v = _split_qkv(arch, _take(src, m + "self_attention.linear_qkv.bias"))
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        if arch.qk_norm:
            out[a + "q_norm.weight"] = _take(src, m + "self_attention.q_layernorm.weight")
            out[a + "k_norm.weight"] = _take(src, m + "self_attention.k_layernorm.weight")
        out[a + "o_proj.weight"] = _take(src, m + "self_attention.linear_proj.weight")
        out[h + "post_attention_layernorm.weight"] = _take(src, m + "pre_mlp_layernorm.weight")
        gate, up = torch.split(_take(src, m + "mlp.linear_fc1.weight"), arch.intermediate_size, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[h + "mlp.down_proj.weight"] = _take(src, m + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = _take(src, "decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = _take(src, "output_layer.weight")
    else:
        src.pop("output_layer.weight", None)  # a tied model may still list it (PP last stage)
    if src:
        raise KeyError(f"unexpected Megatron tensors: {sorted(src)[:8]}")
    return out


# -- tensor parallelism ---------------------------------------------------------------------------
# How Megatron's local spec shards each tensor over TP ranks: vocab rows (embedding, output
# layer) and column-parallel outputs (QKV, fc1) along dim 0, row-parallel inputs (attention
# output projection, fc2) along dim 1; norms are replicated. fc1 is special: each rank holds its
# slice of gate *and* its slice of up, so the two halves are split separately.
def _tp_axis(name: str) -> int | None:
    if name.endswith(
        ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
    ):
        return 0
    if name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def tp_shard(full: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This TP rank's part of full (unsharded) Megatron tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        axis = _tp_axis(name)
        if axis is None or size == 1:
            out[name] = t
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
        else:
            if t.shape[axis] % size:
                raise ValueError(
                    f"{name}: dimension {axis} of {tuple(t.shape)} is not divisible by TP size {size}"
                )
            out[name] = t.chunk(size, dim=axis)[rank].contiguous()
    return out


def tp_unshard(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from every TP rank's part (rank order); the inverse of `tp_shard`."""
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        axis = _tp_axis(name)
        if axis is None or len(parts) == 1:
            out[name] = parts[0]
        elif name.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
        else:
            out[name] = torch.cat(parts, dim=axis)
    return out
