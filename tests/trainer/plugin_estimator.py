"""A user's advantage estimator, loaded by import path in tests/trainer/test_estimators.py: the
worked example of docs/trainer.md ("Your own estimator"), verbatim."""

from __future__ import annotations

import torch

from palaestra.trainer.estimators import AdvantageContext


def leave_one_out(ctx: AdvantageContext) -> torch.Tensor:
    """RLOO (https://arxiv.org/abs/2402.14740): each sample's reward minus the mean reward of the
    other samples of its group; 0 in a group of one."""
    advantages = torch.zeros(ctx.num_samples)
    for group in dict.fromkeys(ctx.group_ids):  # first-seen order
        idx = torch.tensor([i for i, g in enumerate(ctx.group_ids) if g == group])
        if len(idx) > 1:
            r = ctx.rewards[idx]
            advantages[idx] = r - (r.sum() - r) / (len(idx) - 1)
    return advantages


def one_per_group(ctx: AdvantageContext) -> torch.Tensor:
    """A broken estimator (the wrong shape), for the error it gets."""
    return torch.zeros(len(set(ctx.group_ids)))


def not_a_number(ctx: AdvantageContext) -> torch.Tensor:
    """A broken estimator (NaN where the reward is 0), for the error it gets."""
    return torch.where(ctx.rewards == 0, torch.nan, ctx.rewards)


NOT_CALLABLE = 3
