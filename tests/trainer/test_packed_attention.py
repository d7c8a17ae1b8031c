"""The trainer's packed attention against the engine's kernel call: `scaled_dot_product_attention`
with a boolean causal mask, the call the embedded engine's prefill makes. The trainer passes
``is_causal=True`` instead (no [n, n] mask); outputs and gradients must stay bit-identical, so the
trainer's recomputed logprobs do not move."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from palaestra.trainer.packed_attention import PackedCausalAttention


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] attention as the engine's prefill computes it (boolean causal mask)."""
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _attention(heads: int, kv_heads: int, d: int) -> PackedCausalAttention:
    layer = PackedCausalAttention.__new__(PackedCausalAttention)  # no Megatron config needed for _attend
    torch.nn.Module.__init__(layer)
    layer.dropout, layer.softmax_scale = 0.0, d**-0.5
    return layer


@pytest.mark.parametrize("n", [1, 7, 300, 2048])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_outputs_and_gradients_equal_the_masked_call_bit_for_bit(n, heads, kv_heads):
    torch.manual_seed(n)
    d = 32
    base = [torch.randn(1, heads, n, d), torch.randn(1, kv_heads, n, d), torch.randn(1, kv_heads, n, d)]
    grad = torch.randn(1, heads, n, d)
    layer = _attention(heads, kv_heads, d)
    results = []
    for attend in (_masked, layer._attend):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = attend(q, k, v)
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for mine, engine in zip(results[1], results[0], strict=True):
        assert torch.equal(mine, engine)


def test_packed_sequences_do_not_see_each_other():
    """THD input: each packed sequence attends only to itself, as if run alone."""
    torch.manual_seed(0)
    heads, d, lengths = 2, 16, [5, 1, 9]
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d) for _ in range(3))
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    layer = _attention(heads, heads, d)
    out = layer.forward(q, k, v, None, packed_seq_params=params).reshape(total, heads, d)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = _masked(*(x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)))[0].transpose(0, 1)
        assert torch.equal(out[start:end], alone)
