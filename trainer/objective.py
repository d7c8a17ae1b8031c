"""The training objective of one micro-batch, its per-token inputs, and the step metrics it reports.

`token_inputs` fills a micro-batch's per-row inputs from the estimator's per-sample advantages
(the sampled-granularity OPD and KL-reward terms, RS keep masks, TIS weights); `microbatch_loss` turns the logits of a packed micro-batch into the numerator and denominator of
the global loss (`losses.aggregate`) plus a vector of per-token sums for the metrics;
`step_metrics` turns those sums, added over micro-batches and DP ranks, into namespaced metrics.
Per response token t, with w_t = loss_mask_t · rs_keep_t:

    lp_t   = log_softmax(logits / T)[x_t]                      (differentiable)
    ℓ_t    = PPO-clip(lp_t, old_t, Â_t) · tis_t                 (tis_t = 1 without TIS)
           + β_kl · kl(lp_t, ref_t)                             (kl.mode "loss" only)
           + β_T · D_t                  (rows of a topk or full teacher T: opd_kl.py, docs/opd.md)
    loss   = Σ_mb Σ_t w_t ℓ_t / Σ_mb n_mb                       (token_mean; seq_mean per sequence)

The division by the global denominator is Megatron's own (`calculate_per_token_loss`: the
schedule sums the denominators and `finalize_model_grads` scales the gradients by their DP sum).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from palaestra.trainer import advantages as adv
from palaestra.trainer import losses, opd_kl
from palaestra.trainer.config import TrainerConfig
from palaestra.trainer.packing import MicroBatch

__all__ = ["NO_SIGNAL_ATOL", "SUM_KEYS", "microbatch_loss", "step_metrics", "token_inputs"]

# Per-token sums reduced over micro-batches and DP ranks, then divided by their denominator.
SUM_KEYS = (
    "loss_num", "loss_den", "pg_loss", "kl", "entropy", "clipped", "dual_clipped", "ratio", "tokens",
    "mask_tokens", "abs_diff", "mismatch_kl", "tis_clipped", "rs_masked", "opd_rkl", "teacher_tokens",
    "nll", "no_signal", "mismatch_tokens",
)  # fmt: skip

NO_SIGNAL_ATOL = 1e-8
"""|Â_t| at or below this is no signal: a group whose rewards are all equal gets a centred reward
of a rounding error (0.1, 0.1, 0.1 averages to 0.1 + 1.4e-17), not always exactly 0."""


def token_inputs(mb: MicroBatch, per_sample: torch.Tensor, c: TrainerConfig) -> None:
    """Fills `mb.advantages`, `loss_weight` and the TIS fields from the estimator's advantage of each
    sample (`per_sample`, [N] over the step's samples) and the logprobs already in `mb`:
    Â_t = A_i, then the OPD term of sampled-granularity rows and the KL-reward term; w_t =
    loss_mask · rs_keep; TIS weights with tis.enabled."""
    assert mb.old_logprobs is not None
    lengths = torch.tensor(
        [b - a for a, b in zip(mb.response_offsets[:-1], mb.response_offsets[1:], strict=True)]
    )
    a = per_sample[mb.sample_indices].repeat_interleave(lengths) if mb.sample_indices else mb.old_logprobs * 0
    if mb.opd_coef_sampled is not None:  # sampled-granularity teachers: the advantage term
        a = adv.opd_adjust(a, mb.old_logprobs, mb.teacher_logprobs, mb.opd_coef_sampled)
    if c.kl.coef > 0 and c.kl.mode == "reward":
        kl = losses.kl_estimate(mb.old_logprobs, mb.ref_logprobs, c.kl.estimator)
        a = adv.kl_reward_adjust(a, kl, c.kl.coef)
    mb.advantages = a
    # rows sampled under a decoding constraint: the engine's logprob is the constrained one, so the
    # ratio old / rollout measures the grammar, not a mismatch; they keep weight 1 (Sample.constrained)
    free = None if mb.constrained is None else mb.constrained == 0
    keep = torch.ones_like(mb.loss_mask)
    if c.rs.mode is not None:
        mask = mb.loss_mask if free is None else mb.loss_mask * free
        keep = losses.rs_keep_mask(
            mb.old_logprobs, mb.rollout_logprobs, mask, mb.seq_index, c.rs.low, c.rs.high, c.rs.mode
        )
        if free is not None:
            keep = torch.where(free, keep, torch.ones_like(keep))
    mb.loss_weight = mb.loss_mask * keep
    if c.tis.enabled:
        w, clipped = losses.tis_weights(mb.old_logprobs, mb.rollout_logprobs, c.tis.clip_low, c.tis.clip_high)
        if free is not None:
            w, clipped = torch.where(free, w, torch.ones_like(w)), clipped & free
        mb.tis_weight, mb.tis_clipped = w, clipped.float()
    mb.check()


def distill_terms(
    mb: MicroBatch, rows: torch.Tensor, c: TrainerConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(β_t·D_t to add to the loss, D_t detached, β_t > 0) of the topk/full teachers' rows; None if
    the micro-batch has none. Rows of other granularities have β_t = 0 (opd_step.py fills the fields)."""
    if mb.opd_topk_ids is None and mb.opd_full_teacher is None:
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    dev = rows.device
    term = rows.new_zeros(rows.shape[0], dtype=torch.float32)
    value = torch.zeros_like(term)
    active = torch.zeros_like(term, dtype=torch.bool)
    if mb.opd_topk_ids is not None:
        d = opd_kl.topk_reverse_kl(
            rows, mb.opd_topk_ids.to(dev), mb.opd_topk_teacher.to(dev), c.temperature, group,
            mb.opd_topk_valid.to(dev),
        )  # fmt: skip
        coef = mb.opd_coef_topk.to(dev)
        term, value, active = term + coef * d, torch.where(coef > 0, d.detach(), value), active | (coef > 0)
    if mb.opd_full_teacher is not None:
        d = opd_kl.full_reverse_kl(rows, mb.opd_full_teacher, c.temperature, c.opd.full_chunk_rows, group)
        coef = mb.opd_coef_full.to(dev)
        term, value, active = term + coef * d, torch.where(coef > 0, d.detach(), value), active | (coef > 0)
    return term, value, active


def microbatch_loss(
    mb: MicroBatch,
    rows: torch.Tensor,
    c: TrainerConfig,
    inputs: Callable[[MicroBatch], None] | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(loss numerator, denominator, metric sums in `SUM_KEYS` order) from the rows' logits [R, V/tp].

    `inputs`: the old-policy pass is this forward (`Trainer.separate_old_pass`): `mb.old_logprobs`
    are lp_t detached, then `inputs(mb)` fills the per-token inputs that read them (`token_inputs`).
    With OPD, `mb.opd_rkl` is set to each row's reverse-KL estimate (k1 on sampled-
    granularity rows, D_t on topk/full rows; detached, on CPU) for per-teacher metrics.
    """
    dev = rows.device
    lp = losses.vocab_parallel_logprobs(rows, mb.targets.to(dev), c.temperature)
    if inputs is not None:
        mb.old_logprobs = lp.detach().float().cpu()
        mb.check()
        inputs(mb)
    entropy = losses.vocab_parallel_entropy(rows, c.temperature)
    old, a = mb.old_logprobs.to(dev), mb.advantages.to(dev)
    pl = losses.policy_loss(lp, old, a, c.eps_clip, c.eps_clip_high, c.dual_clip_c)
    token_loss = pl.loss * mb.tis_weight.to(dev) if c.tis.enabled else pl.loss
    kl = torch.zeros_like(lp)
    if c.kl.coef > 0:
        kl = losses.kl_estimate(lp, mb.ref_logprobs.to(dev), c.kl.estimator)
        if c.kl.mode == "loss":
            token_loss = token_loss + c.kl.coef * kl
    direct = distill_terms(mb, rows, c)
    if direct is not None:
        token_loss = token_loss + direct[0]
    weight = mb.loss_weight.to(dev)
    num, den = losses.aggregate(token_loss, weight, mb.seq_index.to(dev), c.loss_agg)
    with torch.no_grad():
        m = mb.loss_mask.to(dev)
        mm = m if mb.constrained is None else m * (1 - mb.constrained.to(dev))  # rows the trainer can compare
        roll = mb.rollout_logprobs.to(dev)
        zero = m.new_zeros(())
        teacher = mb.teacher_logprobs.to(dev) if mb.teacher_logprobs is not None else None
        silent = a.abs() <= NO_SIGNAL_ATOL  # rows with no learning signal (step_metrics)
        if direct is not None:
            silent &= ~direct[2]
        stats = {
            "loss_num": num.detach(),
            "loss_den": torch.tensor(float(den), device=dev),
            "pg_loss": (pl.loss * weight).sum(),
            "kl": (kl.detach() * weight).sum(),
            "entropy": (entropy * weight).sum(),
            "clipped": (pl.clipped.float() * weight).sum(),
            "dual_clipped": (pl.dual_clipped.float() * weight).sum(),
            "ratio": (pl.ratio * weight).sum(),
            "tokens": weight.sum(),
            "mask_tokens": m.sum(),
            "abs_diff": ((old - roll).abs() * mm).sum(),
            "mismatch_kl": (losses.kl_estimate(roll, old, "k3") * mm).sum(),
            "tis_clipped": (mb.tis_clipped.to(dev) * mm).sum() if c.tis.enabled else zero,
            "rs_masked": ((1 - weight) * mm).sum(),
            "opd_rkl": ((old - teacher) * m).sum() if teacher is not None else zero,
            "teacher_tokens": m.sum() if teacher is not None else zero,
            "nll": (-old * weight).sum(),
            "no_signal": (silent.float() * weight).sum(),
            "mismatch_tokens": mm.sum(),
        }
        sums = torch.stack([stats[k].float() for k in SUM_KEYS])
        if teacher is not None:
            rkl = old - teacher
            if direct is not None:
                rkl = torch.where(direct[1] != 0, direct[1], rkl)
            mb.opd_rkl = rkl.detach().cpu()
    return num, den, sums


def step_metrics(sums: torch.Tensor, c: TrainerConfig) -> dict[str, float]:
    """train/, mismatch/ and opd/ metrics from `SUM_KEYS` sums over the whole step (all DP ranks).

    train/* averages over the tokens that train (loss mask after RS); mismatch/* over every
    policy-sampled token but those sampled under a decoding constraint (whose engine logprob is the
    constrained distribution's; mismatch/constrained_fraction is their share); opd/reverse_kl is the k1 estimate mean(old − teacher) over them.
    train/zero_advantage_fraction is the share of training tokens that carry no learning signal:
    |Â_t| ≤ `NO_SIGNAL_ATOL` and no topk/full distillation term (the KL to the reference is not
    counted: it only pulls back towards the initial weights). 1.0 means a zero policy gradient.
    """
    s = dict(zip(SUM_KEYS, sums.tolist(), strict=True))
    tok, mask = max(s["tokens"], 1.0), max(s["mismatch_tokens"], 1.0)
    metrics = {
        "train/loss": s["loss_num"] / max(s["loss_den"], 1.0),
        "train/pg_loss": s["pg_loss"] / tok,
        "train/kl": s["kl"] / tok,
        "train/entropy": s["entropy"] / tok,
        "train/clipfrac": s["clipped"] / tok,
        "train/dual_clipfrac": s["dual_clipped"] / tok,
        "train/ratio_mean": s["ratio"] / tok,
        "train/loss_tokens": s["tokens"],
        "train/nll": s["nll"] / tok,
        "train/zero_advantage_fraction": s["no_signal"] / tok,
        "mismatch/logprob_abs_diff": s["abs_diff"] / mask,
        "mismatch/kl": s["mismatch_kl"] / mask,
        "mismatch/tis_clip_frac": s["tis_clipped"] / mask,
        "mismatch/rs_mask_frac": s["rs_masked"] / mask,
        "mismatch/constrained_fraction": 1.0 - s["mismatch_tokens"] / max(s["mask_tokens"], 1.0),
    }
    if c.opd.enabled:
        metrics["opd/reverse_kl"] = s["opd_rkl"] / max(s["teacher_tokens"], 1.0)
        metrics["opd/kl_coef"] = c.opd.kl_coef
    return metrics
