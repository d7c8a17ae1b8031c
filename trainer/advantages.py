"""Advantage estimators and the per-token terms added to them. Pure functions over tensors.

Sequence-level estimators (one advantage per sample, broadcast to its response tokens); each has a
function of the step's `AdvantageContext` (`grpo_estimator`, ...) that the table of estimators in
trainer/estimators.py names (`advantage_estimator: grpo`), the signature a user's estimator has:

* `grpo`: Â_i = (r_i − mean_g) / (std_g + eps), statistics within the sample's `group_id`
  (https://arxiv.org/abs/2402.03300). Per group, never across the batch.
* `dr_grpo`: Â_i = r_i − mean_g — no std division (https://arxiv.org/abs/2503.20783).
* `reinforce_pp_baseline`: Â_i = r_i − mean_g, then whitened over all loss tokens of the batch,
  (Â − μ_tok) / (σ_tok + eps) (REINFORCE++ with baseline, https://arxiv.org/abs/2501.03262).
* `sft`: Â_i = 1 for every sample; rewards and groups are ignored. With one optimizer step per
  call the PPO ratio is 1 (old = the weights being trained), so the gradient is exactly that of the
  mean negative log-likelihood of the loss-mask tokens: supervised fine-tuning on given responses
  (`palaestra.environments.math.warmstart` uses it to warm-start the demo's teacher and student).
* `none`: Â_i = 0; only the per-token terms below remain — with `opd.kl_coef` > 0 that is pure
  on-policy distillation (rewards ignored).

Groups and forks. A group's statistics are over its *sessions*, not its samples: a session whose
history was rewritten forks into several samples of the same group (same `session_id`), and it is
still one rollout with one reward. So each session counts once in mean_g and std_g (its reward is
the mean of its samples' rewards, which the gateway sets equal), and every fork gets its session's
advantage. Groups may have any size; a group with a single session gets advantage 0 (nothing to
compare with). std_g is the sample standard deviation (Bessel-corrected, torch.std's default).

Per-token terms (applied after the estimator, to every response token, orthogonal to it):

* `opd_adjust`: Â_t = A_t − β·(log πθ(x_t) − log π_teacher(x_t)), β = `opd.kl_coef`
  (on-policy distillation; A = 0 is pure distillation by reverse KL).
* `kl_reward_adjust`: Â_t = A_t − β_kl·kl_t, the KL to the reference policy as a reward penalty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from palaestra.trainer.estimators import AdvantageContext

__all__ = [
    "dr_grpo",
    "dr_grpo_estimator",
    "grpo",
    "grpo_estimator",
    "group_centered",
    "kl_reward_adjust",
    "opd_adjust",
    "reinforce_pp_baseline",
    "reinforce_pp_estimator",
    "sft",
    "sft_estimator",
    "zero",
    "zero_estimator",
    "zero_variance_groups",
]


def _session_rewards(
    rewards: torch.Tensor, group_ids: Sequence[str], session_ids: Sequence[str]
) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Group -> its distinct sessions (first-seen order), session -> mean reward of its samples."""
    if not (len(rewards) == len(group_ids) == len(session_ids)):
        raise ValueError(
            f"{len(rewards)} rewards, {len(group_ids)} group ids and {len(session_ids)} session ids"
        )
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    groups: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for r, g, s in zip(rewards.tolist(), group_ids, session_ids, strict=True):
        if owner.setdefault(s, g) != g:
            raise ValueError(f"session {s!r} appears in groups {owner[s]!r} and {g!r}")
        if s not in sums:
            groups.setdefault(g, []).append(s)
        sums[s] = sums.get(s, 0.0) + r
        counts[s] = counts.get(s, 0) + 1
    return groups, {s: sums[s] / counts[s] for s in sums}


def group_centered(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    session_ids: Sequence[str],
    *,
    divide_by_std: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(r_i − mean_g) [/ (std_g + eps)] per sample, with sessions counted once (module docstring)."""
    groups, session_reward = _session_rewards(rewards, group_ids, session_ids)
    mean: dict[str, float] = {}
    std: dict[str, float] = {}
    for g, sessions in groups.items():
        values = torch.tensor([session_reward[s] for s in sessions], dtype=torch.float64)
        mean[g] = float(values.mean())
        std[g] = float(values.std()) if len(sessions) > 1 else 0.0
    out = torch.empty(len(rewards), dtype=torch.float32)
    for i, (g, s) in enumerate(zip(group_ids, session_ids, strict=True)):
        if len(groups[g]) == 1:
            out[i] = 0.0
            continue
        centered = session_reward[s] - mean[g]
        out[i] = centered / (std[g] + eps) if divide_by_std else centered
    return out


def grpo(
    rewards: torch.Tensor, group_ids: Sequence[str], session_ids: Sequence[str], eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r − mean_g) / (std_g + eps), per sample."""
    return group_centered(rewards, group_ids, session_ids, divide_by_std=True, eps=eps)


def dr_grpo(rewards: torch.Tensor, group_ids: Sequence[str], session_ids: Sequence[str]) -> torch.Tensor:
    """Dr.GRPO: r − mean_g, per sample (no std normalisation)."""
    return group_centered(rewards, group_ids, session_ids, divide_by_std=False)


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    session_ids: Sequence[str],
    loss_tokens: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++-baseline: r − mean_g, whitened over the batch's loss tokens, per sample.

    `loss_tokens[i]` is sample i's number of loss-masked tokens: each sample's advantage is
    constant over its tokens, so the token-level mean and (population) std of the whole batch
    follow from per-sample values weighted by token counts — identical on every DP rank
    without communication.
    """
    centered = group_centered(rewards, group_ids, session_ids, divide_by_std=False).double()
    w = loss_tokens.double()
    if w.shape != centered.shape:
        raise ValueError(f"loss_tokens {tuple(w.shape)} for {tuple(centered.shape)} samples")
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(centered, dtype=torch.float32)
    mu = (w * centered).sum() / total
    sigma = ((w * (centered - mu) ** 2).sum() / total).sqrt()
    return ((centered - mu) / (sigma + eps)).float()


def sft(num_samples: int) -> torch.Tensor:
    """SFT: advantage 1 for every sample (the policy-gradient loss becomes the NLL's gradient)."""
    return torch.ones(num_samples, dtype=torch.float32)


def zero(num_samples: int) -> torch.Tensor:
    """`none`: no sequence-level advantage (pure on-policy distillation with opd.kl_coef > 0)."""
    return torch.zeros(num_samples, dtype=torch.float32)


def zero_variance_groups(
    rewards: torch.Tensor, group_ids: Sequence[str], session_ids: Sequence[str]
) -> tuple[int, int]:
    """(groups whose sessions all have the same reward, groups): the groups a group-centred
    estimator gives advantage 0 (a group of one session included: nothing to compare with)."""
    groups, session_reward = _session_rewards(rewards, group_ids, session_ids)
    flat = sum(1 for sessions in groups.values() if len({session_reward[s] for s in sessions}) == 1)
    return flat, len(groups)


# -- the built-in estimators of the table (trainer/estimators.py), written as a user's would be ----
def grpo_estimator(ctx: AdvantageContext) -> torch.Tensor:
    """``grpo``: (r − mean_g) / (std_g + eps) per group, sessions counted once."""
    return grpo(ctx.rewards, ctx.group_ids, ctx.session_ids, eps=ctx.eps)


def dr_grpo_estimator(ctx: AdvantageContext) -> torch.Tensor:
    """``dr_grpo``: r − mean_g per group (no std division)."""
    return dr_grpo(ctx.rewards, ctx.group_ids, ctx.session_ids)


def reinforce_pp_estimator(ctx: AdvantageContext) -> torch.Tensor:
    """``reinforce_pp_baseline``: r − mean_g, whitened over the batch's policy-sampled tokens."""
    return reinforce_pp_baseline(ctx.rewards, ctx.group_ids, ctx.session_ids, ctx.sampled_tokens, eps=ctx.eps)


def sft_estimator(ctx: AdvantageContext) -> torch.Tensor:
    """``sft``: 1 for every sample (rewards ignored)."""
    return sft(ctx.num_samples)


def zero_estimator(ctx: AdvantageContext) -> torch.Tensor:
    """``none``: 0 for every sample (rewards ignored; OPD's terms remain)."""
    return zero(ctx.num_samples)


# -- per-token terms -------------------------------------------------------------------------------
def opd_adjust(
    advantages: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, coef: float
) -> torch.Tensor:
    """Â_t = A_t − β·(log πθ(x_t) − log π_teacher(x_t)) (all per token, logprobs detached)."""
    if not (advantages.shape == student_logprobs.shape == teacher_logprobs.shape):
        raise ValueError(
            f"shapes differ: advantages {tuple(advantages.shape)}, student {tuple(student_logprobs.shape)}, "
            f"teacher {tuple(teacher_logprobs.shape)}"
        )
    return advantages - coef * (student_logprobs - teacher_logprobs)


def kl_reward_adjust(advantages: torch.Tensor, kl: torch.Tensor, coef: float) -> torch.Tensor:
    """Â_t = A_t − β_kl·kl_t (KL to the reference model as a per-token reward penalty)."""
    if advantages.shape != kl.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} vs kl {tuple(kl.shape)}")
    return advantages - coef * kl
