"""Sampled-token OPD, checked against the exact reverse KL through the trainer's own objective.

The student is a table: logits Z[c, t] for prompt token c and response position t, over a
12-token vocabulary, independent of the tokens sampled before t — so every position's reverse KL
KL(p_ct ‖ q_ct) is exact and cheap, and samples are independent. The teacher is another table.
Responses are sampled from softmax(Z / T); each batch goes through the trainer's path for a
`sampled` route — `objective.token_inputs` (estimator `none`: Â_t = −β·(log p(x_t) − log q(x_t)))
then `objective.microbatch_loss` (PPO-clip at ratio 1, token mean) — and autograd gives its
gradient w.r.t. Z. Two claims:

* the mean of that gradient over many samples is the exact gradient of β · mean_ct KL(p_ct ‖ q_ct)
  (the `full` granularity's term), within the Monte-Carlo standard error — and it is not the
  gradient of a teacher shifted by one position or of the opposite sign (what a misaligned or
  sign-flipped implementation would give);
* repeated small steps lower the exact reverse KL, step after step.
"""

from __future__ import annotations

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import objective
from palaestra.trainer.config import OpdOptions, TrainerConfig
from palaestra.trainer.packing import build_micro_batch

VOCAB, PROMPTS, LENGTH, BETA = 12, 3, 4, 0.5


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    from palaestra.trainer.megatron_model import init_parallel

    init_parallel({"tensor_model_parallel_size": 1})  # the objective's vocab-parallel CE (one process)


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(PROMPTS, LENGTH, VOCAB, generator=g) * 1.5
    teacher = torch.log_softmax(torch.randn(PROMPTS, LENGTH, VOCAB, generator=g) * 2.5, -1)
    return student, teacher


def exact_reverse_kl(z: torch.Tensor, log_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """mean over (c, t) of KL(softmax(z / T) ‖ q), written out (differentiable)."""
    log_p = torch.log_softmax(z / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def sampled_opd_loss(
    z: torch.Tensor, log_q: torch.Tensor, per_prompt: int, c: TrainerConfig, g: torch.Generator
) -> torch.Tensor:
    """The trainer's loss (numerator / denominator) on `per_prompt` samples of every prompt."""
    with torch.no_grad():
        log_p = torch.log_softmax(z / c.temperature, -1)
        prompts = torch.arange(PROMPTS).repeat_interleave(per_prompt)  # [N]
        x = torch.multinomial(log_p[prompts].exp().reshape(-1, VOCAB), 1, generator=g).reshape(-1, LENGTH)
        pos = torch.arange(LENGTH)
        old = log_p[prompts[:, None], pos, x]  # [N, L]: the pre-update pass's logprobs
        teacher = log_q[prompts[:, None], pos, x]
    samples = [
        Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{int(p)}", env="table", task_id="",
               tokens=[int(p), *x[i].tolist()], prompt_len=1, loss_mask=[1] * LENGTH,
               rollout_logprobs=old[i].tolist(), weight_versions=[""] * LENGTH)
        for i, p in enumerate(prompts.tolist())
    ]  # fmt: skip
    mb = build_micro_batch(samples, list(range(len(samples))))
    mb.old_logprobs = old.reshape(-1)
    mb.teacher_logprobs = teacher.reshape(-1)
    mb.opd_coef_sampled = torch.full((mb.num_rows,), c.opd.kl_coef)
    objective.token_inputs(mb, torch.zeros(len(samples)), c)  # estimator `none`
    rows = z[prompts].reshape(-1, VOCAB)  # response row (i, t) is predicted by Z[c_i, t]
    num, den, _ = objective.microbatch_loss(mb, rows, c)
    return num / den


def _grad(fn, z: torch.Tensor) -> torch.Tensor:
    x = z.clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mean_sampled_gradient_is_the_exact_reverse_kl_gradient(temperature):
    c = TrainerConfig(
        temperature=temperature,
        advantage_estimator="none",
        opd=OpdOptions(kl_coef=BETA, teacher_mode="megatron", teacher_model="table"),
    )
    z, log_q = _tables()
    g = torch.Generator().manual_seed(1)
    batches = torch.stack(
        [_grad(lambda x: sampled_opd_loss(x, log_q, 2000, c, g), z) for _ in range(10)]
    )  # 10 independent estimates, 24,000 tokens each
    mean, se = batches.mean(0), batches.std(0) / batches.shape[0] ** 0.5
    exact = _grad(lambda x: BETA * exact_reverse_kl(x, log_q, temperature), z)
    shifted = _grad(lambda x: BETA * exact_reverse_kl(x, log_q.roll(1, dims=1), temperature), z)

    def err(target: torch.Tensor) -> float:  # squared error over its expectation: ≈ 1 when unbiased
        # summed over entries, not an average of per-entry z-scores: an entry of a token the student
        # almost never samples has a heavy-tailed estimate whose spread 10 batches do not see
        return float(((mean - target) ** 2).sum() / (se**2).sum())

    assert err(exact) < 2.0, f"squared error {err(exact):.2f} x what the sampling noise explains"
    assert err(shifted) > 50.0 and err(-exact) > 50.0  # the check tells a wrong target apart
    cos = torch.nn.functional.cosine_similarity(mean.flatten(), exact.flatten(), 0)
    assert cos > 0.99, f"cosine {cos:.4f}"


def test_small_sampled_steps_lower_the_exact_reverse_kl():
    c = TrainerConfig(
        temperature=1.0,
        advantage_estimator="none",
        opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model="table"),
    )
    z, log_q = _tables()
    z.requires_grad_(True)
    opt = torch.optim.SGD([z], lr=1.0)
    g = torch.Generator().manual_seed(2)
    kls = [float(exact_reverse_kl(z.detach(), log_q, 1.0))]
    for _ in range(30):
        opt.zero_grad()
        sampled_opd_loss(z, log_q, 200, c, g).backward()  # 2,400 tokens per step
        opt.step()
        kls.append(float(exact_reverse_kl(z.detach(), log_q, 1.0)))
    rises = [(i, b - a) for i, (a, b) in enumerate(zip(kls[:-1], kls[1:], strict=True)) if b > a + 0.01]
    assert not rises, f"the exact reverse KL rose at steps {rises}: {kls}"
    assert kls[-1] < 0.5 * kls[0], kls
