"""Tokens sampled under a decoding constraint (regex, JSON schema, grammar) in the trainer's objective.

The engine masks the logits to the grammar before it samples and reports that masked distribution's
logprob, which is higher than the unconstrained policy's (the trainer's) wherever the grammar cut
probability mass away. Such a token's old / rollout ratio measures the grammar, not a train/rollout
mismatch: the sample marks it (`Sample.constrained`), and `objective.token_inputs` /
`microbatch_loss` leave it out of TIS, RS and the mismatch/* metrics while it still trains.
"""

from __future__ import annotations

import pytest
import torch

from palaestra.sample import Sample, SampleError
from palaestra.trainer import objective
from palaestra.trainer.config import RsOptions, TisOptions, TrainerConfig
from palaestra.trainer.packing import build_micro_batch

VOCAB, LENGTH = 8, 4
GRAMMAR_GAIN = 1.5
"""What the constrained logprob adds over the unconstrained one (the issue measured ~1.5 nats)."""


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    from palaestra.trainer.megatron_model import init_parallel

    init_parallel({"tensor_model_parallel_size": 1})  # the objective's vocab-parallel CE (one process)


def _step(constrained: list[int], c: TrainerConfig, marked: bool = True) -> tuple[dict[str, float], object]:
    """One micro-batch of two samples: the first sampled free, the second under `constrained`
    (recorded on the sample when `marked`); every rollout logprob equals the trainer's except where
    the grammar raised it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * LENGTH, VOCAB, generator=g)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=g)
    old = torch.log_softmax(logits, -1)[torch.arange(2 * LENGTH), tokens.reshape(-1)].reshape(2, LENGTH)
    gain = torch.tensor([[0.0] * LENGTH, [GRAMMAR_GAIN * m for m in constrained]])
    samples = [
        Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id="g", env="e", task_id="",
               tokens=[0, *tokens[i].tolist()], prompt_len=1, loss_mask=[1] * LENGTH,
               rollout_logprobs=(old[i] + gain[i]).tolist(), weight_versions=[""] * LENGTH,
               constrained=constrained if i == 1 and marked else None)
        for i in range(2)
    ]  # fmt: skip
    mb = build_micro_batch(samples, [0, 1])
    mb.old_logprobs = old.reshape(-1)
    objective.token_inputs(mb, torch.tensor([1.0, -1.0]), c)
    _, _, sums = objective.microbatch_loss(mb, logits, c)
    return objective.step_metrics(sums, c), mb


def test_constrained_tokens_stay_out_of_mismatch_tis_and_rs():
    c = TrainerConfig(tis=TisOptions(enabled=True, clip_low=0.5, clip_high=2.0), rs=RsOptions(mode="token"))
    metrics, mb = _step([1, 1, 1, 0], c)
    assert metrics["mismatch/logprob_abs_diff"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["mismatch/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["mismatch/tis_clip_frac"] == 0.0 and metrics["mismatch/rs_mask_frac"] == 0.0
    assert metrics["mismatch/constrained_fraction"] == pytest.approx(3 / 8)
    assert mb.tis_weight.tolist() == pytest.approx([1.0] * 8)  # a weight of 1, not exp(-1.5) clipped
    assert mb.loss_weight.tolist() == [1.0] * 8  # every token trains: none rejected by RS
    # the same rollout unmarked is what was reported before: 1.5 nats on 3 of 8 tokens read as a
    # mismatch, their TIS weights exp(-1.5) clipped and RS rejecting them
    metrics, mb = _step([1, 1, 1, 0], c, marked=False)
    assert metrics["mismatch/logprob_abs_diff"] == pytest.approx(GRAMMAR_GAIN * 3 / 8, rel=1e-5)
    assert metrics["mismatch/rs_mask_frac"] == pytest.approx(3 / 8) and "constrained" not in str(
        mb.constrained
    )
    assert metrics["mismatch/constrained_fraction"] == 0.0


def test_sequence_rs_averages_over_the_unconstrained_tokens_only():
    c = TrainerConfig(rs=RsOptions(mode="sequence", low=0.9, high=1.1))
    metrics, mb = _step([1, 1, 0, 0], c)
    assert mb.loss_weight.tolist() == [1.0] * 8 and metrics["mismatch/rs_mask_frac"] == 0.0


def _marked_sample() -> Sample:
    return Sample(sample_id="s", session_id="s", group_id="g", env="e", task_id="", tokens=[0, 1, 2],
                  prompt_len=1, loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0], weight_versions=["", ""],
                  constrained=[1, 0])  # fmt: skip


def test_the_marks_round_trip_and_their_length_is_checked():
    s = _marked_sample()
    assert Sample.from_dict(s.to_dict()).constrained == [1, 0]
    with pytest.raises(SampleError, match="constrained has 1 entries for 2 response tokens"):
        Sample.from_dict({**s.to_dict(), "constrained": [1]})
