"""The old-policy logprobs taken from the update's own forward (`Trainer.separate_old_pass` is None)
train exactly as the separate pass did: the same loss, gradients, weights and metrics over two
steps (tiny preset, CPU); and a configuration whose old pass must stay apart still runs it."""

from __future__ import annotations

import functools
import random
import shutil

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig, objective
from palaestra.trainer import trainer as trainer_module
from palaestra.trainer.config import KlOptions, OpdOptions, RsOptions, TisOptions

# timings differ between any two runs; `old_pass_fused` is what the two paths differ in by design
_NOT_COMPARED = ("perf/old_pass_fused", "perf/tokens_per_s")


def _samples(n: int = 8, seed: int = 5) -> list[Sample]:
    """Rewards that vary within each group of 4 and rollout logprobs near the trainer's, so TIS
    clips some tokens and RS masks some sequences but not all."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 9))]
        resp = [rng.randrange(3, 4000) for _ in range(rng.randint(5, 30))]
        s = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(rng.random() < 0.5) + 0.1 * i)  # fmt: skip
        shift = -8.3 + (0.8 if i % 3 == 0 else 0.0)  # every third sample off by a ratio of e^-0.8
        s.append(resp, sampled=True, logprobs=[shift + rng.uniform(-0.6, 0.6) for _ in resp])
        out.append(s)
    return out


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The tiny preset with its weights perturbed: a teacher that differs from the student."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("teacher") / "tiny-teacher"
    shutil.copytree(tiny_model_dir, root)
    g = torch.Generator().manual_seed(3)
    tensors = {
        k: v + 0.05 * torch.randn(v.shape, generator=g)
        for k, v in load_file(root / "model.safetensors").items()
    }
    save_file(tensors, root / "model.safetensors")
    return str(root)


def _grads(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in t.gpt.named_parameters() if p.requires_grad}


def _compare(config: TrainerConfig, model_dir) -> tuple[Trainer, Trainer, list[float]]:
    """Two steps of a fused and a separate-pass trainer on the same batches: asserts they agree;
    returns both and the losses."""
    fused, apart = Trainer(config, model_dir), Trainer(config, model_dir)
    assert fused.separate_old_pass() is None
    apart.separate_old_pass = lambda k=0: "the separate pass, for comparison"
    losses = []
    for step, batch in enumerate((_samples(seed=5), _samples(seed=6))):
        a, b = fused.step(batch), apart.step(batch)
        assert (a["perf/old_pass_fused"], b["perf/old_pass_fused"]) == (1.0, 0.0)
        assert a.keys() == b.keys()
        for key in a:
            if key in _NOT_COMPARED or (key.startswith(("perf/", "opd/")) and key.endswith("_s")):
                continue
            assert a[key] == pytest.approx(b[key], abs=1e-6, rel=1e-6), f"step {step + 1}: {key}"
        ga, gb = _grads(fused), _grads(apart)
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            assert torch.allclose(ga[name], gb[name], rtol=0, atol=1e-6), f"step {step + 1}: grad of {name}"
        wa, wb = fused.hf_state(), apart.hf_state()
        for name in wa:
            assert torch.allclose(wa[name], wb[name], rtol=0, atol=1e-6), f"step {step + 1}: weight {name}"
        assert a["train/update_successful"] == 1.0 and a["train/grad_norm"] > 0
        losses.append(a["train/loss"])
    return fused, apart, losses


def _record_partials(monkeypatch) -> list:
    """The functions the trainer module wraps in `partial` from now on (a recording stand-in for
    functools.partial that builds the same objects)."""
    built = []
    monkeypatch.setattr(
        trainer_module, "partial", lambda f, *a, **kw: built.append(f) or functools.partial(f, *a, **kw)
    )
    return built


def test_grpo_fused_matches_the_separate_pass(tiny_model_dir, monkeypatch):
    built = _record_partials(monkeypatch)
    _, _, losses = _compare(
        TrainerConfig(megatron_optimizer={"lr": 1e-3}, max_tokens_per_microbatch=96), tiny_model_dir
    )
    assert losses[0] != losses[1]  # the second step ran on updated weights
    # the update's per-token inputs: built by the fused trainer's two steps, never by the separate pass
    assert built.count(objective.token_inputs) == 2


def test_grpo_with_tis_rs_and_kl_reward_fused_matches_the_separate_pass(tiny_model_dir):
    """Every per-token input that reads the old logprobs: TIS weights, RS masks (per sequence),
    the KL-reward term (with the reference pass between the two)."""
    config = TrainerConfig(
        megatron_optimizer={"lr": 1e-3},
        max_tokens_per_microbatch=96,
        tis=TisOptions(enabled=True, clip_low=0.5, clip_high=1.5),
        rs=RsOptions(mode="sequence", low=0.6, high=1.6),
        kl=KlOptions(coef=0.05, mode="reward"),
    )
    fused, _, _ = _compare(config, tiny_model_dir)
    metrics = fused.step(_samples(seed=7))
    # the comparison covered clipping and masking that happened (neither all nor nothing)
    assert 0 < metrics["mismatch/tis_clip_frac"] < 1 and 0 < metrics["mismatch/rs_mask_frac"] < 1


def test_opd_full_fused_matches_the_separate_pass(tiny_model_dir, teacher_dir):
    config = TrainerConfig(
        advantage_estimator="none",
        megatron_optimizer={"lr": 1e-3},
        max_tokens_per_microbatch=96,
        opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model=teacher_dir, granularity="full"),
    )
    fused, _, _ = _compare(config, tiny_model_dir)
    assert fused.step(_samples(seed=7))["opd/reverse_kl"] != 0


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"keep_old_actor": True}, "keep_old_actor"),
        ({"megatron": {"hidden_dropout": 0.1}}, "dropout"),
        (
            {"opd": {"kl_coef": 1.0, "teacher_mode": "megatron", "granularity": "topk", "topk": 4}},
            "topk teacher",
        ),
    ],
    ids=["keep_old_actor", "dropout", "opd_topk"],
)
def test_what_cannot_fuse_still_runs_the_separate_pass(tiny_model_dir, options, reason, monkeypatch):
    """(routing_replay r2 also keeps it: tests/trainer/test_moe.py sees its old pass record.)"""
    if "opd" in options:  # the student itself is teacher enough to need its top-k ids
        options["opd"]["teacher_model"] = str(tiny_model_dir)
    t = Trainer(TrainerConfig(**options), tiny_model_dir)
    calls = []
    original = t._student_pass
    monkeypatch.setattr(t, "_student_pass", lambda *a: calls.append(a[1:]) or original(*a))
    built = _record_partials(monkeypatch)
    metrics = t.step(_samples())
    assert objective.token_inputs not in built  # the fused path's inputs: the old pass filled them
    k = 4 if "opd" in options else 0
    assert reason in t.separate_old_pass(k)
    assert metrics["perf/old_pass_fused"] == 0.0
    assert calls == [("old_actor" if "keep_old_actor" in options else "actor", k)]
