"""The engine's own modules for the dense Llama-family models it serves (Qwen2, Qwen3, Llama,
Mistral), so that an engine starts without importing transformers' modeling code.

Why: `AutoModelForCausalLM.from_pretrained` imports transformers' model-loading machinery, and with
it torch.distributed's tensor package (sympy) and torch._dynamo. For the `tiny` preset that is
~1.7 s of the ~3.9 s of CPU an engine took to be ready (`bench.engine_start`, with bytecode
caches), paid at every engine start and restart (every training test starts at least one). The engine needs none of it: `model_runner.ModelRunner` drives
the layers itself and only calls their submodules (`q_proj`, `input_layernorm`, `mlp`,
`rotary_emb`, ...).

What: a module tree with transformers' names and shapes (`model.layers.0.self_attn.q_proj`, ...),
so weight updates, LoRA adapters and checkpoints name the same tensors, and with the same
operations in the same order, so the numerics are bit-identical (tests/engine/test_native_model.py
compares each dense architecture's logits and KV, and the `tiny` preset's, through prefill and
decode with the transformers model's: equal, not close, once both models' weights sit in freshly
allocated memory). The weights are read from the safetensors files by `weights.load_safetensors_into`,
the reader `/update_weights_from_disk` uses.

What it does not cover falls back to transformers, with the reason in the log: mixture-of-experts
architectures (their expert kernels are transformers' choice), RoPE other than the default one, an
activation other than SiLU, a checkpoint whose tensor names or shapes do not match. `palaestra
engine serve --model-impl transformers` always takes transformers' modules; `--model-impl native`
refuses a model it cannot serve natively instead of falling back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MODEL_IMPLS = ("auto", "native", "transformers")


class Unsupported(Exception):
    """The model needs something these modules do not implement (the message says what)."""


class Linear(nn.Linear):
    """`nn.Linear` left uninitialised: every weight is read from the checkpoint. (Building on the
    meta device instead would import torch._dynamo through torch's reference ops.)"""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """`nn.Embedding` left uninitialised, as `Linear`."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """The projections (and Qwen3's per-head norms) of one layer; `ModelRunner` does the attention."""

    def __init__(self, cfg: Any, arch: str, head_dim: int):
        super().__init__()
        hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, _kv_heads(cfg)
        qkv_bias = o_bias = bool(getattr(cfg, "attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False
        self.scaling = head_dim**-0.5
        self.q_proj = Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=o_bias)
        if arch == "Qwen3ForCausalLM":
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, arch: str, head_dim: int):
        super().__init__()
        self.self_attn = Attention(cfg, arch, head_dim)
        mlp_bias = bool(getattr(cfg, "mlp_bias", False)) if arch == "LlamaForCausalLM" else False
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """Default RoPE: `forward(x, positions)` returns (cos, sin) [batch, seq, head_dim] in x's dtype."""

    def __init__(self, theta: float, dim: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Model(nn.Module):
    def __init__(self, cfg: Any, arch: str, head_dim: int, theta: float):
        super().__init__()
        pad = getattr(cfg, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < cfg.vocab_size else None
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, pad)
        self.layers = nn.ModuleList(DecoderLayer(cfg, arch, head_dim) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(theta, head_dim)


class CausalLM(nn.Module):
    """What `ModelRunner` and the engine use of a transformers `*ForCausalLM`: `.config`,
    `.model` (embed_tokens, layers, norm, rotary_emb), `.lm_head`, `get_output_embeddings()`."""

    def __init__(self, cfg: Any, arch: str, head_dim: int, theta: float):
        super().__init__()
        self.config = cfg
        self.model = Model(cfg, arch, head_dim, theta)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def _kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _plan(cfg: Any) -> tuple[str, int, float]:
    """(architecture, head_dim, rope theta) of a model these modules serve; Unsupported otherwise."""
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    if arch not in NATIVE_ARCHITECTURES:
        raise Unsupported(f"architecture {arch} (native: {', '.join(NATIVE_ARCHITECTURES)})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Unsupported(f"activation {cfg.hidden_act!r} (native: silu)")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise Unsupported(f"rope parameters {rope!r} (native: the default RoPE with rope_theta)")
    if rope.get("rope_type", "default") != "default":
        raise Unsupported(f"RoPE type {rope.get('rope_type')!r} (native: default)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("a partial rotary embedding")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return arch, int(head_dim), float(rope["rope_theta"])


def load(model_path: str | Path, cfg: Any) -> CausalLM:
    """The model at `model_path` (a HF directory of safetensors weights; `cfg` its loaded config)
    in float32 on CPU, in eval mode. Raises Unsupported for what these modules do not serve,
    before reading any weight."""
    from palaestra.engine.protocol import RequestError
    from palaestra.engine.weights import load_safetensors_into, safetensors_names

    arch, head_dim, theta = _plan(cfg)
    try:
        names = safetensors_names(model_path)
    except Exception as exc:  # no safetensors files, or unreadable ones: transformers may know better
        raise Unsupported(f"the weights: {exc}") from None
    model = CausalLM(cfg, arch, head_dim, theta)
    model.tie()
    # A tied model lists its head once, as the embedding (named_parameters drops the repeat): a
    # checkpoint of it that carries lm_head.weight anyway is left to transformers' rules.
    params = dict(model.named_parameters())
    unknown = sorted(names - params.keys())
    missing = sorted(params.keys() - names)
    if unknown or missing:
        raise Unsupported(
            f"checkpoint names: {len(unknown)} unknown (e.g. {unknown[:2]}), {len(missing)} missing (e.g. {missing[:2]})"
        )
    try:
        load_safetensors_into(model_path, params)  # checks every name and shape before a write
    except RequestError as exc:
        raise Unsupported(f"the weights: {exc}") from None
    return model.eval()
