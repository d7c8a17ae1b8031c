"""The table of advantage estimators (trainer/estimators.py): each name gives exactly its formula,
a user's estimator by import path trains, bad values are named at config load, and the trainer's
no-signal metrics (train/zero_variance_groups, train/zero_advantage_fraction)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer import advantages as adv
from palaestra.trainer.estimators import ESTIMATORS, AdvantageContext, estimate, load_estimator
from palaestra.typed_config import field_docs

PLUGIN = "plugin_estimator"  # tests/trainer/plugin_estimator.py, put on the import path below


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return PLUGIN


def _ctx() -> AdvantageContext:
    """Uneven groups, a forked session (s1 twice), a group of one, fractional rewards."""
    return AdvantageContext(
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.25, 0.5, 0.5, 0.1, 0.7]),
        group_ids=("a", "a", "a", "a", "b", "b", "c", "d"),
        session_ids=("s1", "s1", "s2", "s3", "s4", "s5", "s6", "s7"),
        sampled_tokens=torch.tensor([3.0, 4.0, 5.0, 1.0, 2.0, 6.0, 7.0, 0.0]),
        eps=1e-3,
    )


def test_each_table_name_gives_exactly_its_formula():
    ctx = _ctx()
    r, g, s = ctx.rewards, ctx.group_ids, ctx.session_ids
    want = {
        "grpo": adv.grpo(r, g, s, eps=1e-3),
        "dr_grpo": adv.dr_grpo(r, g, s),
        "reinforce_pp_baseline": adv.reinforce_pp_baseline(r, g, s, ctx.sampled_tokens, eps=1e-3),
        "sft": torch.ones(8),
        "none": torch.zeros(8),
    }
    assert set(ESTIMATORS) == set(want)
    for name, expected in want.items():
        got = estimate(load_estimator(name), ctx, name)
        assert got.dtype == torch.float32 and torch.equal(got, expected), name
    # a table entry is an import path like a user's: the same function either way
    assert load_estimator("grpo") is load_estimator(ESTIMATORS["grpo"]) is adv.grpo_estimator


def test_the_context_is_built_from_the_samples_in_order():
    samples = []
    for i, (reward, sampled) in enumerate([(1.0, 3), (0.0, 2), (0.5, 4)]):
        s = Sample(sample_id=f"x{i}", session_id=f"s{i}", group_id="g", env="e", task_id="t",
                   tokens=[1, 2], prompt_len=2, reward=reward)  # fmt: skip
        s.append([5] * sampled, sampled=True, logprobs=[-1.0] * sampled)
        s.append([6, 6], sampled=False)
        samples.append(s)
    ctx = AdvantageContext.of(samples, eps=0.5)
    assert torch.equal(ctx.rewards, torch.tensor([1.0, 0.0, 0.5]))
    assert ctx.group_ids == ("g",) * 3 and ctx.session_ids == ("s0", "s1", "s2")
    assert torch.equal(ctx.sampled_tokens, torch.tensor([3.0, 2.0, 4.0])) and ctx.eps == 0.5
    assert ctx.num_samples == 3


def test_config_accepts_table_names_and_import_paths_and_names_the_choices(plugin_path):
    for name in ESTIMATORS:
        assert TrainerConfig(advantage_estimator=name).advantage_estimator == name
    assert TrainerConfig(advantage_estimator=f"{plugin_path}:leave_one_out")
    with pytest.raises(ValueError, match=r"'grpoo': expected one of grpo, dr_grpo, reinforce_pp_baseline, "
                       r"sft, none \(did you mean 'grpo'\?\), or the import path"):  # fmt: skip
        TrainerConfig(advantage_estimator="grpoo")
    with pytest.raises(
        ValueError, match="advantage_estimator 'nowhere_mod:f': no module named 'nowhere_mod'"
    ):
        TrainerConfig(advantage_estimator="nowhere_mod:f")
    with pytest.raises(ValueError, match=f"'{plugin_path}' has no attribute 'missing'"):
        TrainerConfig(advantage_estimator=f"{plugin_path}:missing")
    with pytest.raises(ValueError, match="which is not callable"):
        TrainerConfig(advantage_estimator=f"{plugin_path}:NOT_CALLABLE")


def test_the_config_field_documents_every_table_name():
    doc = field_docs(TrainerConfig)["advantage_estimator"]
    assert all(f"{name}:" in doc for name in ESTIMATORS), doc
    assert "package.module:function" in doc


def test_a_bad_estimator_result_names_the_estimator(plugin_path):
    ctx = _ctx()
    name = f"{plugin_path}:one_per_group"
    with pytest.raises(
        ValueError, match=r"one_per_group' returned shape \(4,\) for 8 samples; .* shape \(8,\)"
    ):
        estimate(load_estimator(name), ctx, name)
    name = f"{plugin_path}:not_a_number"
    with pytest.raises(ValueError, match=r"not_a_number' returned non-finite advantages for samples \[2\]"):
        estimate(load_estimator(name), ctx, name)
    with pytest.raises(ValueError, match="returned list for 8 samples"):
        estimate(lambda c: [0.0] * 8, ctx, "mine")


def _samples(rewards: list[float], per_group: int = 2, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i, reward in enumerate(rewards):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 8))]
        resp = [rng.randrange(3, 4000) for _ in range(rng.randint(6, 16))]
        s = Sample(sample_id=f"x{i}", session_id=f"s{i}", group_id=f"g{i // per_group}", env="math",
                   task_id="t", tokens=prompt, prompt_len=len(prompt), reward=reward)  # fmt: skip
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


def test_a_custom_estimator_by_import_path_trains(tiny_model_dir, plugin_path):
    cfg = TrainerConfig(advantage_estimator=f"{plugin_path}:leave_one_out", megatron_optimizer={"lr": 1e-3})
    t = Trainer(cfg, tiny_model_dir)
    batch = _samples([1.0, 0.0, 0.0, 0.0, 1.0, 0.5], per_group=3)
    before = {k: v.clone() for k, v in t.hf_state().items()}
    metrics = t.step(batch)
    # its advantages are the ones the trainer trained with: RLOO = n/(n−1) · (r − mean_g) here
    mbs, _ = t._schedule(batch)
    t._store(mbs, "old_logprobs", t.logprobs(mbs))
    t._advantages(batch, mbs)
    rloo = 1.5 * adv.dr_grpo(torch.tensor([s.reward for s in batch]), [s.group_id for s in batch],
                             [s.session_id for s in batch])  # fmt: skip
    for mb in mbs:
        for i, a in zip(mb.sample_indices, mb.per_sample(mb.advantages), strict=True):
            assert torch.allclose(a, rloo[i].expand_as(a), atol=1e-6), (i, a, rloo[i])
    assert metrics["train/grad_norm"] > 0 and metrics["train/update_successful"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in t.hf_state().items())  # the weights moved
    assert metrics["train/zero_variance_groups"] == 0.0 and metrics["train/groups"] == 2.0


def test_a_step_without_learning_signal_says_so_in_its_metrics(tiny_model_dir):
    t = Trainer(TrainerConfig(megatron_optimizer={"lr": 1e-3}), tiny_model_dir)
    flat = t.step(_samples([0.0, 0.0, 1.0, 1.0, 0.3, 0.3]), sync=False)  # 3 groups, each all equal
    assert flat["train/zero_variance_groups"] == 3.0 and flat["train/groups"] == 3.0
    assert flat["train/zero_advantage_fraction"] == 1.0
    assert flat["train/grad_norm"] == 0.0  # what the metric predicts: nothing to learn from
    mixed = t.step(_samples([0.0, 1.0, 1.0, 1.0, 0.3, 0.3]), sync=False)  # one group with a signal
    assert mixed["train/zero_variance_groups"] == 2.0
    assert 0.0 < mixed["train/zero_advantage_fraction"] < 1.0 and mixed["train/grad_norm"] > 0
    # sft trains every token whatever the rewards: no zero advantage, though the groups are flat
    sft = Trainer(TrainerConfig(advantage_estimator="sft"), tiny_model_dir)
    m = sft.step(_samples([0.0, 0.0, 1.0, 1.0]), sync=False)
    assert m["train/zero_variance_groups"] == 2.0 and m["train/zero_advantage_fraction"] == 0.0


def test_zero_variance_groups_count_sessions_once_and_groups_of_one():
    r = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.2])
    groups, sessions = ["a", "a", "a", "b", "b", "c"], ["s1", "s1", "s2", "s3", "s4", "s5"]
    assert adv.zero_variance_groups(r, groups, sessions) == (2, 3)  # b (equal) and c (alone)
    assert adv.zero_variance_groups(r[:2], groups[:2], sessions[:2]) == (1, 1)  # one session, forked
