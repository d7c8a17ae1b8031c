"""HF ⇄ Megatron weight conversion for Llama-family models (Llama, Mistral, Qwen2, Qwen3) and their
mixture-of-experts relatives (Qwen3-MoE; GLM-4-MoE, the DeepSeek-V3 routing layout).

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

A mixture-of-experts layer (`HFArchitecture.moe_layers`) has, in place of ``mlp.{gate,up,down}_proj``:

=====================================================  ============================================
HF                                                     Megatron
=====================================================  ============================================
model.layers.{i}.mlp.gate.weight                       decoder.layers.{i}.mlp.router.weight
model.layers.{i}.mlp.gate.e_score_correction_bias      decoder.layers.{i}.mlp.router.expert_bias
                                                       (a buffer; GLM/DeepSeek layout only)
model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight decoder.layers.{i}.mlp.experts.local_experts.{e}
                                                       .linear_fc1.weight (gate rows, then up)
model.layers.{i}.mlp.experts.{e}.down_proj.weight      ....local_experts.{e}.linear_fc2.weight
model.layers.{i}.mlp.shared_experts.*_proj.weight      decoder.layers.{i}.mlp.shared_experts.linear_fc{1,2}
                                                       .weight (GLM/DeepSeek layout only)
=====================================================  ============================================

HF names are those of the checkpoint files (one tensor per expert), which is also what weight sync
sends; transformers fuses them into ``[experts, ...]`` tensors only when it loads a model.
With expert parallelism each rank holds `experts / EP` of the experts, numbered from 0 locally
(`ep_localize` / `ep_globalize` map the numbers); with pipeline parallelism each stage numbers its
layers from 0 (`pp_stage` / `pp_globalize`).

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HFArchitecture",
    "ep_globalize",
    "ep_localize",
    "hf_to_megatron",
    "megatron_to_hf",
    "pp_globalize",
    "pp_stage",
    "tp_shard",
    "tp_unshard",
]

_SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
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
    rotary_percent: float = 1.0  # the share of each head's dimensions that RoPE rotates (GLM: 0.5)
    # Mixture of experts (0 experts: a dense model; the fields below are then unused).
    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()  # which layers route to experts; the others are dense
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    router_score: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (GLM/DeepSeek)
    norm_topk_prob: bool = True  # the k chosen weights renormalised to sum to 1
    expert_bias: bool = False  # sigmoid routing chooses by score + e_score_correction_bias
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    routed_scaling_factor: float = 1.0
    router_groups: int = 1  # group-limited routing (n_group / topk_group); 1: plain top-k
    router_group_topk: int = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        partial = partial if partial is not None else getattr(cfg, "partial_rotary_factor", 1.0)
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
            qk_norm=family in ("qwen3", "qwen3_moe") or bool(getattr(cfg, "use_qk_norm", False)),
            rotary_percent=float(partial),
            **_moe_fields(family, cfg),
        )


def _moe_fields(family: str, cfg: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of `HFArchitecture` for a HF config (none for a dense one)."""
    n = cfg.num_hidden_layers
    if family == "qwen3_moe":
        skip = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        return {
            "num_experts": cfg.num_experts,
            "moe_layers": tuple(i for i in range(n) if i not in skip and (i + 1) % step == 0),
            "moe_topk": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "router_score": "softmax",
            "norm_topk_prob": bool(cfg.norm_topk_prob),
        }
    if family == "glm4_moe":
        if not cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            raise ValueError(
                "sigmoid routing without norm_topk_prob is not supported: Megatron always renormalises "
                "the chosen sigmoid scores when more than one expert is chosen"
            )
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        return {
            "num_experts": cfg.n_routed_experts,
            "moe_layers": tuple(range(int(getattr(cfg, "first_k_dense_replace", 0) or 0), n)),
            "moe_topk": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "router_score": "sigmoid",
            "norm_topk_prob": bool(cfg.norm_topk_prob),
            "expert_bias": True,
            "shared_expert_intermediate_size": shared * cfg.moe_intermediate_size,
            "routed_scaling_factor": float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
            "router_groups": int(getattr(cfg, "n_group", 1) or 1),
            "router_group_topk": int(getattr(cfg, "topk_group", 1) or 1),
        }
    return {}


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


def _mlp_names(arch: HFArchitecture, layer: int) -> list[tuple[str, str]]:
    """(HF prefix, Megatron prefix) of each SwiGLU MLP in `layer`: the dense MLP, or every expert
    and the shared expert of an MoE layer."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    if layer not in arch.moe_layers:
        return [(h, m)]
    names = [(f"{h}experts.{e}.", f"{m}experts.local_experts.{e}.") for e in range(arch.num_experts)]
    if arch.shared_expert_intermediate_size:
        names.append((h + "shared_experts.", m + "shared_experts."))
    return names


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
        for hf_mlp, mg_mlp in _mlp_names(arch, i):
            out[mg_mlp + "linear_fc1.weight"] = torch.cat(
                [_take(src, hf_mlp + "gate_proj.weight"), _take(src, hf_mlp + "up_proj.weight")], dim=0
            )
            out[mg_mlp + "linear_fc2.weight"] = _take(src, hf_mlp + "down_proj.weight")
        if i in arch.moe_layers:
            out[m + "mlp.router.weight"] = _take(src, h + "mlp.gate.weight")
            if arch.expert_bias:
                out[m + "mlp.router.expert_bias"] = _take(src, h + "mlp.gate.e_score_correction_bias")
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
        for hf_mlp, mg_mlp in _mlp_names(arch, i):
            gate, up = _take(src, mg_mlp + "linear_fc1.weight").chunk(2, dim=0)
            out[hf_mlp + "gate_proj.weight"], out[hf_mlp + "up_proj.weight"] = gate.clone(), up.clone()
            out[hf_mlp + "down_proj.weight"] = _take(src, mg_mlp + "linear_fc2.weight")
        if i in arch.moe_layers:
            out[h + "mlp.gate.weight"] = _take(src, m + "mlp.router.weight")
            if arch.expert_bias:
                out[h + "mlp.gate.e_score_correction_bias"] = _take(src, m + "mlp.router.expert_bias")
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


# -- expert parallelism ---------------------------------------------------------------------------
# With expert_model_parallel_size EP, EP rank r holds experts [r·E/EP, (r+1)·E/EP) of every MoE
# layer as local_experts.0 .. E/EP-1; everything else is the same on every EP rank.
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def ep_localize(
    full: Mapping[str, torch.Tensor], rank: int, size: int, num_experts: int
) -> dict[str, torch.Tensor]:
    """This EP rank's part of whole-model Megatron tensors (its experts, renumbered from 0)."""
    if size == 1:
        return dict(full)
    if num_experts % size:
        raise ValueError(f"{num_experts} experts do not divide over expert_model_parallel_size {size}")
    per = num_experts // size
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        elif rank * per <= int(m[2]) < (rank + 1) * per:
            out[f"{m[1]}{int(m[2]) - rank * per}{m[3]}"] = t
    return out


def ep_globalize(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole-model tensors from every EP rank's part (rank order); the inverse of `ep_localize`."""
    if len(parts) == 1:
        return dict(parts[0])
    per = 1 + max((int(m[2]) for name in parts[0] if (m := _EXPERT.match(name))), default=-1)
    out: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for name, t in part.items():
            m = _EXPERT.match(name)
            if m is None:
                out.setdefault(name, t)
            else:
                out[f"{m[1]}{int(m[2]) + rank * per}{m[3]}"] = t
    return out


# -- pipeline parallelism -------------------------------------------------------------------------
# Pipeline stage s of P holds layers [s·L/P, (s+1)·L/P) as decoder.layers.0 .. L/P-1; the first
# stage also the embedding, the last the final norm and the output layer.
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def pp_stage(
    full: Mapping[str, torch.Tensor], first_layer: int, num_layers: int, first: bool, last: bool
) -> dict[str, torch.Tensor]:
    """The tensors of one pipeline stage from whole-model ones, its layers numbered from 0."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m is not None:
            if first_layer <= int(m[1]) < first_layer + num_layers:
                out[f"decoder.layers.{int(m[1]) - first_layer}.{m[2]}"] = t
        elif name.startswith("embedding.") and first:
            out[name] = t
        elif name.startswith(("decoder.final_layernorm.", "output_layer.")) and last:
            out[name] = t
    return out


def pp_globalize(stage: Mapping[str, torch.Tensor], first_layer: int) -> dict[str, torch.Tensor]:
    """A stage's tensors under whole-model layer numbers (the inverse of `pp_stage`'s renumbering)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in stage.items():
        m = _LAYER.match(name)
        out[f"decoder.layers.{int(m[1]) + first_layer}.{m[2]}" if m else name] = t
    return out
