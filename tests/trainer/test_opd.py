"""Multi-teacher OPD through the real Megatron trainer (tiny preset, CPU): routing, granularities,
the snapshot store's disk tier, per-teacher metrics, and the student moving to its teachers."""

from __future__ import annotations

import random

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.config import OpdOptions, SnapshotOptions


def _samples(env: str, n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 8))]
        resp = [rng.randrange(3, 4000) for _ in range(rng.randint(6, 16))]
        s = Sample(sample_id=f"{env}{i}", session_id=f"{env}{i}", group_id=f"{env}g{i // 2}", env=env,
                   task_id="t", tokens=prompt, prompt_len=len(prompt), reward=0.0)  # fmt: skip
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


@pytest.fixture(scope="module")
def teachers(tiny_model_dir, tmp_path_factory):
    """Two teachers: the tiny preset with two different weight perturbations."""
    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for name, seed in (("math", 1), ("words", 2)):
        t = Trainer(TrainerConfig(), tiny_model_dir)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in t.gpt.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        out[name] = str(t.export_hf(root / name))
    return out


def _gap(t: Trainer, samples: list[Sample], tag: str) -> float:
    mbs, _ = t._schedule(samples)
    lp, teacher = t.logprobs(mbs), t.logprobs(mbs, tag=tag, temperature=1.0)
    return float(torch.cat([(a - b) ** 2 for a, b in zip(lp, teacher, strict=True)]).mean())


@pytest.mark.slow
def test_two_teachers_two_granularities_under_a_spilling_budget(tiny_model_dir, teachers, tmp_path):
    probe = Trainer(TrainerConfig(), tiny_model_dir)
    copies = 2.5  # the actor and one teacher fit; the other teacher lives on disk
    cfg = TrainerConfig(
        advantage_estimator="none",
        megatron_optimizer={"lr": 3e-3},
        opd=OpdOptions(
            kl_coef=1.0,
            teachers={
                "math": {"mode": "megatron", "model": teachers["math"], "granularity": "topk", "topk": 16},
                "words": {"mode": "megatron", "model": teachers["words"], "granularity": "full"},
            },
        ),
        snapshot=SnapshotOptions(
            host_budget_gb=copies * probe.snapshots.nbytes / 1e9, spill_dir=str(tmp_path / "spill")
        ),
    )
    del probe
    t = Trainer(cfg, tiny_model_dir)
    math, words = _samples("math", 6, 1), _samples("words", 6, 2)
    batch = math + words
    before = {"math": _gap(t, math, "teacher/math"), "words": _gap(t, words, "teacher/words")}
    cross = {"math": _gap(t, math, "teacher/words"), "words": _gap(t, words, "teacher/math")}
    metrics = [t.step(batch) for _ in range(5)]
    after = {"math": _gap(t, math, "teacher/math"), "words": _gap(t, words, "teacher/words")}
    cross_after = {"math": _gap(t, math, "teacher/words"), "words": _gap(t, words, "teacher/math")}
    print(
        f"\nstudent-teacher gap before {before} after {after}; to the other teacher {cross} -> {cross_after}"
    )
    print({k: round(v, 4) for k, v in metrics[-1].items() if k.startswith(("opd/", "perf/snap"))})
    assert {s.teacher for s in math} == {"math"} and {s.teacher for s in words} == {"words"}
    for env in ("math", "words"):
        rkl = [m[f"opd/{env}/reverse_kl"] for m in metrics]  # the exact top-k / full KL
        print(env, [round(x, 4) for x in rkl])
        assert rkl[-1] < 0.75 * rkl[0], (env, rkl)
        assert metrics[-1][f"opd/{env}/share"] == pytest.approx(0.5)
        assert metrics[-1][f"opd/{env}/score_s"] > 0
    # the full-vocabulary teacher moves every token's logprob, the sampled (random) ones too,
    # towards its own teacher and not towards the other; top-k only touches the student's top 16
    assert after["words"] < before["words"] and after["words"] < cross_after["words"]
    assert sum(m["perf/snap_disk_to_host_mb"] for m in metrics) > 0  # a teacher came back from disk
    assert t.snapshots.host_bytes <= copies * t.snapshots.nbytes


def test_panel_records_mixture_routes_and_sampled_teachers_enter_the_advantage(tiny_model_dir, teachers):
    cfg = TrainerConfig(
        advantage_estimator="none",
        opd=OpdOptions(
            kl_coef=0.5,
            teachers={
                "math": {"mode": "megatron", "model": teachers["math"]},
                "words": {"mode": "megatron", "model": teachers["words"], "opd_kl_coef": 0.0},
            },
            teacher_mixtures={"mix": {"math": 1.0, "words": 1.0}},
        ),
    )
    t = Trainer(cfg, tiny_model_dir)
    batch = _samples("mix", 4, 3) + _samples("words", 2, 4)
    metrics = t.step(batch)
    assert {s.teacher for s in batch[:4]} == {"0.5*math+0.5*words"}
    assert metrics["opd/math/share"] == pytest.approx(2 / 6) and metrics["opd/words/share"] == pytest.approx(
        4 / 6
    )
    # the mixture's β is 0.5·0.5 + 0.5·0; the words-only samples have β 0: their advantage stays 0
    mbs, _ = t._schedule(batch)
    routes = t.distiller.route(batch)
    old = t.logprobs(mbs)
    t._store(mbs, "old_logprobs", old)
    t.distiller.score(batch, mbs, routes, {})
    t._advantages(batch, mbs)
    for mb in mbs:
        for i, a, lp, tl in zip(mb.sample_indices, mb.per_sample(mb.advantages), mb.per_sample(mb.old_logprobs),
                                mb.per_sample(mb.teacher_logprobs), strict=True):  # fmt: skip
            beta = 0.25 if batch[i].env == "mix" else 0.0
            assert torch.allclose(a, -beta * (lp - tl), atol=1e-6)
