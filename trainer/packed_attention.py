"""Core attention for packed (THD) micro-batches with Megatron's local layer spec.

Megatron's local `DotProductAttention` refuses `packed_seq_params` ("use TEDotProductAttention"),
and TransformerEngine does not run on CPU. Everything around core attention already handles THD
in megatron-core itself: `SelfAttention` squeezes q/k/v to ``[tokens, heads, head_dim]`` and
applies RoPE per sequence from ``cu_seqlens`` (positions restart at 0 for each packed sequence).
So the only missing piece is the attention kernel, and this module supplies it: causal
`scaled_dot_product_attention` over each packed sequence on its own, so no token ever sees another
sequence and no padding is processed. It replaces `core_attention` in `get_gpt_layer_local_spec()`;
the rest of the spec is Megatron's.

It uses the kernel of the embedded engine's prefill (`torch.nn.functional.scaled_dot_product_attention`),
which keeps the trainer's recomputed logprobs close to the engine's rollout logprobs. The engine
passes a boolean causal mask (its prefill may start after a cached prefix); here every sequence
starts at 0, so ``is_causal=True`` asks for the same thing without building the [n, n] mask: on
CPU the outputs and gradients are bit-identical to the masked call
(tests/trainer/test_packed_attention.py), and a long sample no longer allocates n² booleans per
layer and call (an 18k-token harness episode: 324 MB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["PackedCausalAttention"]


class PackedCausalAttention(MegatronModule):
    """Causal self-attention over ``[s, b, heads, d]`` or packed ``[t, heads, d]`` (THD) inputs.

    Constructor arguments are those Megatron passes to any `core_attention` submodule.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCausalAttention is causal only, got {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs TransformerEngine attention (not the local spec)")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [b, hq, s, d], k/v: [b, hkv, s, d] -> [b, hq, s, d]."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            # [s, b, h, d] -> [b, h, s, d]; causal over the whole row (no padding is ever built)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._attend(q, k, v)  # [b, h, s, d]
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        cu = packed_seq_params.cu_seqlens_q
        if packed_seq_params.cu_seqlens_q_padded is not None or not torch.equal(
            cu, packed_seq_params.cu_seqlens_kv
        ):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv and no padding")
        bounds = cu.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the pack has {query.shape[0]} tokens")
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs.append(self._attend(q, k, v)[0].transpose(0, 1))  # [len, h, d]
        return torch.cat(outs).reshape(query.shape[0], -1)
