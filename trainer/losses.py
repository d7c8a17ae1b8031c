"""Token logprobs, the PPO policy loss, KL estimators, TIS/RS and loss aggregation.

Every function is pure (tensors in, tensors out) except that the two vocab-parallel functions
all-reduce over Megatron's tensor-parallel group (a no-op at TP = 1). Notation per response
token t: lp = log πθ(x_t) (trainer, now), old = log π_old(x_t) (trainer, before the update),
roll = the engine's rollout logprob, ref = reference model, A = advantage. docs/trainer.md
states every formula with its config flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "PolicyLoss",
    "aggregate",
    "kl_estimate",
    "policy_loss",
    "rs_keep_mask",
    "tis_weights",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]

KLEstimator = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "seq_mean"]


def _temperature(temperature: float) -> float:
    # The engine's convention: temperature 0 (greedy) reports logprobs at temperature 1.
    return temperature if temperature > 0 else 1.0


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[target] for vocab-sharded logits [R, V/tp] -> [R] (differentiable).

    Megatron's `vocab_parallel_cross_entropy` is −log p computed across TP ranks, so the same
    call is right at every TP size.
    """
    from megatron.core import tensor_parallel

    scaled = logits.float() / _temperature(temperature)  # a fresh tensor: the CE works in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row, for vocab-sharded logits [R, V/tp] -> [R]."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    x = logits.float() / _temperature(temperature)
    m = x.max(dim=-1).values
    if dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = x - m.unsqueeze(-1)
    e = shifted.exp()
    sums = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    z, ez = sums
    return z.log() - ez / z  # H = log Z − E_p[x − m]


@dataclass
class PolicyLoss:
    """Per-token PPO loss and what the step reports about it (all [R])."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped branch was active
    dual_clipped: torch.Tensor  # bool: the dual-clip bound was active


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """PPO-clip with asymmetric bounds and dual clip, per token.

    ratio = exp(lp − old)
    L = max(−A·ratio, −A·clip(ratio, 1 − eps_clip, 1 + eps_clip_high))
    dual clip (https://arxiv.org/abs/1912.09729), only where A < 0: L = min(L, −A·c), c > 1.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape):
        raise ValueError(
            f"shapes differ: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)}"
        )
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual = torch.zeros_like(was_clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return PolicyLoss(loss=loss, ratio=ratio.detach(), clipped=was_clipped, dual_clipped=dual)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(πθ ‖ π_ref) from samples of πθ (http://joschu.net/blog/kl-approx.html).

    With d = lp − ref: k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d (unbiased, ≥ 0, low variance).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights w = clip(exp(old − roll), clip_low, clip_high) and where they clipped.

    They correct for the engine sampling from a slightly different distribution than the
    trainer computes (https://fengyao.notion.site/off-policy-rl). A weight exactly at a bound
    is not counted as clipped.
    """
    ratio = torch.exp(old_logprobs - rollout_logprobs)
    weights = ratio.clamp(clip_low, clip_high)
    return weights, (ratio < clip_low) | (ratio > clip_high)


def rs_keep_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    low: float,
    high: float,
    mode: Literal["token", "sequence"],
) -> torch.Tensor:
    """Rejection sampling: 1.0 where a token stays in the loss, 0.0 where it is masked out.

    token: mask tokens whose ratio exp(old − roll) is outside [low, high].
    sequence: mask every token of a sequence whose geometric-mean ratio
    exp(mean over its loss tokens of (old − roll)) is outside [low, high]. Bounds are inclusive.
    """
    log_ratio = old_logprobs - rollout_logprobs
    if mode == "token":
        ratio = torch.exp(log_ratio)
        return ((ratio >= low) & (ratio <= high)).float()
    if mode == "sequence":
        n = int(seq_index.max()) + 1 if seq_index.numel() else 0
        sums = log_ratio.new_zeros(n).index_add_(0, seq_index, log_ratio * loss_mask)
        counts = log_ratio.new_zeros(n).index_add_(0, seq_index, loss_mask.to(log_ratio.dtype))
        seq_ratio = torch.exp(sums / counts.clamp(min=1.0))
        keep = (seq_ratio >= low) & (seq_ratio <= high)
        return keep[seq_index].float()
    raise ValueError(f"unknown rejection-sampling mode {mode!r} (token, sequence)")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, mode: Aggregation
) -> tuple[torch.Tensor, int]:
    """(numerator, denominator) of a batch mean, so micro-batches and DP ranks can be summed.

    token_mean: Σ_t m_t·v_t over all loss tokens / number of loss tokens.
    seq_mean:   Σ_s (Σ_t m_t·v_t / Σ_t m_t) / number of sequences with at least one loss token.
    The global loss is Σ numerators / Σ denominators over every micro-batch of every DP rank.
    """
    if not (values.shape == mask.shape == seq_index.shape):
        raise ValueError(
            f"shapes differ: values {tuple(values.shape)}, mask {tuple(mask.shape)}, seq_index {tuple(seq_index.shape)}"
        )
    if mode == "token_mean":
        return (values * mask).sum(), int(mask.sum().item())
    if mode == "seq_mean":
        n = int(seq_index.max()) + 1 if seq_index.numel() else 0
        sums = values.new_zeros(n).index_add(0, seq_index, values * mask)
        counts = mask.new_zeros(n).index_add_(0, seq_index, mask)
        has = counts > 0
        return (sums[has] / counts[has]).sum(), int(has.sum().item())
    raise ValueError(f"unknown aggregation {mode!r} (token_mean, seq_mean)")
