"""Advantage estimators and loss terms against values computed by hand (no model, no Megatron)."""

from __future__ import annotations

import math

import pytest
import torch

from palaestra.trainer import advantages as adv
from palaestra.trainer import losses

S3 = math.sqrt(1 / 3)  # sample std of (1, 0, 0)


def close(a, b, tol=1e-6):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), atol=tol
    )


# -- advantages ------------------------------------------------------------------------------
def test_grpo_normalises_within_each_group_of_uneven_size():
    # group a: 3 sessions (1, 0, 0); group b: 2 sessions (2, 4); group c: 1 session
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 7.0])
    groups = ["a", "a", "a", "b", "b", "c"]
    sessions = ["a1", "a2", "a3", "b1", "b2", "c1"]
    got = adv.grpo(rewards, groups, sessions, eps=0.0)
    # mean_a = 1/3, std_a = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); b: mean 3, std sqrt(2)
    want = [(2 / 3) / S3, (-1 / 3) / S3, (-1 / 3) / S3, -1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]
    assert close(got, want)
    # Not normalised across the batch: a batch-wide mean (14/6) would make every value differ.
    batch_wide = (rewards - rewards.mean()) / rewards.std()
    assert not torch.allclose(got, batch_wide, atol=1e-3)


def test_grpo_counts_a_forked_session_once():
    # Session a1 forked into two samples (same group, same session, same reward).
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    got = adv.grpo(rewards, ["a"] * 4, ["a1", "a1", "a2", "a3"], eps=0.0)
    assert close(got, [(2 / 3) / S3, (2 / 3) / S3, (-1 / 3) / S3, (-1 / 3) / S3])
    # counted per sample instead, the mean would be 1/2 and the fork would pull it up
    per_sample = (rewards - 0.5) / rewards.std()
    assert not torch.allclose(got, per_sample, atol=1e-3)


def test_grpo_eps_and_identical_rewards():
    got = adv.grpo(torch.tensor([1.0, 1.0]), ["g", "g"], ["s1", "s2"], eps=1e-6)
    assert close(got, [0.0, 0.0])  # std 0: 0 / (0 + eps) = 0, no NaN
    got = adv.grpo(torch.tensor([1.0, 0.0]), ["g", "g"], ["s1", "s2"], eps=0.5)
    std = math.sqrt(0.5)
    assert close(got, [0.5 / (std + 0.5), -0.5 / (std + 0.5)])


def test_session_in_two_groups_is_an_error():
    with pytest.raises(ValueError, match="appears in groups"):
        adv.grpo(torch.tensor([1.0, 0.0]), ["a", "b"], ["s", "s"])


def test_dr_grpo_has_no_std():
    got = adv.dr_grpo(torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0]), list("aaabb"), ["1", "2", "3", "4", "5"])
    assert close(got, [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])


def test_reinforce_pp_baseline_whitens_over_loss_tokens():
    # centered (2/3, -1/3, -1/3) with 1, 2, 3 loss tokens: token mean -1/6, token std sqrt(5)/6
    got = adv.reinforce_pp_baseline(
        torch.tensor([1.0, 0.0, 0.0]), ["a"] * 3, ["1", "2", "3"], torch.tensor([1.0, 2.0, 3.0]), eps=0.0
    )
    assert close(got, [math.sqrt(5), -1 / math.sqrt(5), -1 / math.sqrt(5)], tol=1e-5)


def test_opd_adjust_formula_and_zero_when_teacher_equals_student():
    a = torch.zeros(2)
    student, teacher = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    # A = 0 (pure distillation): -0.5 * (student - teacher) = -0.5 * (0.5, -1)
    assert close(adv.opd_adjust(a, student, teacher, 0.5), [-0.25, 0.5])
    a = torch.tensor([0.3, -0.7])
    assert torch.equal(adv.opd_adjust(a, student, student.clone(), 0.5), a)
    with pytest.raises(ValueError, match="shapes differ"):
        adv.opd_adjust(a, student, teacher[:1], 0.5)


def test_kl_reward_adjust():
    assert close(adv.kl_reward_adjust(torch.tensor([1.0, 0.0]), torch.tensor([0.2, -0.4]), 0.5), [0.9, 0.2])


# -- PPO policy loss ----------------------------------------------------------------------------
def _ppo(ratios, advantages, **kw):
    lp = torch.log(torch.tensor(ratios)).requires_grad_(True)
    out = losses.policy_loss(lp, torch.zeros(len(ratios)), torch.tensor(advantages), **kw)
    return lp, out


def test_ppo_clip_each_branch():
    lp, out = _ppo([1.5, 0.5, 1.5, 0.5], [1.0, 1.0, -1.0, -1.0], eps_clip=0.2)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped); A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.5: max(1.5, 1.2) = 1.5; A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert close(out.loss, [-1.2, -0.5, 1.5, 0.8])
    assert out.clipped.tolist() == [True, False, False, True]
    out.loss.sum().backward()
    # d(-A r)/d lp = -A r where unclipped, 0 where the clipped branch is active
    assert close(lp.grad, [0.0, -0.5, 1.5, 0.0])


def test_ppo_clip_high_and_dual_clip():
    _, out = _ppo([1.5], [1.0], eps_clip=0.2, eps_clip_high=0.28)
    assert close(out.loss, [-1.28])
    _, out = _ppo([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], eps_clip=0.2, dual_clip_c=3.0)
    # A<0, r=5: min(max(5, 1.2), 3) = 3 (dual-clipped); r=2: 2 < 3 stays; A>0 is never dual-clipped
    assert close(out.loss, [3.0, 2.0, -1.2])
    assert out.dual_clipped.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="dual_clip_c"):
        _ppo([1.0], [1.0], eps_clip=0.2, dual_clip_c=1.0)


def test_ppo_ratio_one_is_minus_advantage():
    _, out = _ppo([1.0, 1.0], [0.5, -2.0], eps_clip=0.2)
    assert close(out.loss, [-0.5, 2.0]) and not out.clipped.any()


# -- KL estimators ------------------------------------------------------------------------------
def test_kl_estimators():
    lp, ref = torch.tensor([0.5, -1.0]), torch.zeros(2)  # d = 0.5, -1
    assert close(losses.kl_estimate(lp, ref, "k1"), [0.5, -1.0])
    assert close(losses.kl_estimate(lp, ref, "k2"), [0.125, 0.5])
    assert close(losses.kl_estimate(lp, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0])
    assert close(losses.kl_estimate(ref, ref, "k3"), [0.0, 0.0])
    with pytest.raises(ValueError):
        losses.kl_estimate(lp, ref, "k4")


# -- TIS / RS at the bounds ------------------------------------------------------------------
RATIOS = [0.5, 1.0, 2.0, 3.0, 0.1]


def test_tis_weights_truncate_and_count_only_strictly_outside():
    roll = torch.zeros(5)
    w, clipped = losses.tis_weights(torch.log(torch.tensor(RATIOS)), roll, 0.5, 2.0)
    assert close(w, [0.5, 1.0, 2.0, 2.0, 0.5])
    assert clipped.tolist() == [False, False, False, True, True]  # exactly at a bound is not clipped


def test_rs_token_mask_inclusive_bounds():
    keep = losses.rs_keep_mask(
        torch.log(torch.tensor(RATIOS)), torch.zeros(5), torch.ones(5), torch.zeros(5, dtype=torch.long),
        0.5, 2.0, "token",
    )  # fmt: skip
    assert keep.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_rs_sequence_mask_uses_geometric_mean_of_loss_tokens():
    # seq 0: ratios (0.5, 1) -> geo-mean 0.707 keep; seq 1: (2, 3, 0.1) -> 0.843 keep;
    # seq 2: (3, 3) -> 3 drop; seq 3: (1, 100) but the 100 is masked -> 1 keep
    ratios = [0.5, 1.0, 2.0, 3.0, 0.1, 3.0, 3.0, 1.0, 100.0]
    seq = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3])
    mask = torch.tensor([1.0] * 8 + [0.0])
    keep = losses.rs_keep_mask(
        torch.log(torch.tensor(ratios)), torch.zeros(9), mask, seq, 0.5, 2.0, "sequence"
    )
    assert keep.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # exactly at the bound stays
    keep = losses.rs_keep_mask(
        torch.log(torch.tensor([2.0, 2.0])), torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
        0.5, 2.0, "sequence",
    )  # fmt: skip
    assert keep.tolist() == [1.0, 1.0]


# -- aggregation -----------------------------------------------------------------------------
def test_aggregate_token_and_sequence_mean():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 9.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1, 2])  # sequence 2 has no loss token
    num, den = losses.aggregate(values, mask, seq, "token_mean")
    assert (float(num), den) == (7.0, 3)
    num, den = losses.aggregate(values, mask, seq, "seq_mean")
    assert (float(num), den) == (1.5 + 4.0, 2)
    with pytest.raises(ValueError):
        losses.aggregate(values, mask, seq, "sum")
