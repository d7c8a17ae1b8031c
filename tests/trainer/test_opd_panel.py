"""Teacher panel config and routing: env names, envs lists, defaults, import-path functions, mixtures."""

from __future__ import annotations

import math

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import TrainerConfig
from palaestra.trainer.config import OpdOptions
from palaestra.trainer.opd_panel import Route, TeacherPanel, mix_logprobs


def _sample(env: str, i: int = 0) -> Sample:
    return Sample(sample_id=f"{env}{i}", session_id=f"{env}{i}", group_id="g", env=env, task_id="t",
                  tokens=[1, 2, 3], prompt_len=2, loss_mask=[1], rollout_logprobs=[-0.5],
                  weight_versions=["0"])  # fmt: skip


def route_by_length(sample: Sample, teachers):
    """A routing plug-in (loaded by import path in a test below)."""
    return "words" if len(sample.tokens) > 2 else {"math": 0.5, "words": 0.5}


PANEL = {
    "math": {"mode": "megatron", "model": "tiny", "granularity": "topk", "topk": 4},
    "words": {"mode": "sglang", "urls": ["http://127.0.0.1:1"], "opd_kl_coef": 0.2, "envs": ["letters"]},
}


def test_routing_by_environment_name_then_envs_then_default():
    panel = TeacherPanel.from_config(PANEL, default_coef=0.5)
    assert panel.route(_sample("math")).label == "math"
    assert panel.route(_sample("letters")).label == "words"
    with pytest.raises(ValueError, match="no teacher for env 'code'"):
        panel.route(_sample("code"))
    with_default = TeacherPanel.from_config({**PANEL, "default": {"mode": "megatron", "model": "x"}}, 0.5)
    assert with_default.route(_sample("code")).label == "default"
    assert panel.specs["math"].opd_kl_coef == 0.5 and panel.specs["words"].opd_kl_coef == 0.2


def test_groups_put_each_teacher_once_in_panel_order():
    topk_words = {**PANEL, "words": {**PANEL["words"], "granularity": "topk"}}
    panel = TeacherPanel.from_config(topk_words, default_coef=0.5, mixtures={"mix": {"math": 1, "words": 3}})
    routes = [panel.route(_sample(e, i)) for i, e in enumerate(["letters", "math", "mix", "math"])]
    groups = panel.groups(routes)
    assert groups == {"math": [1, 2, 3], "words": [0, 2]}
    assert panel.snapshot_order(groups) == ["teacher/math"]  # the sglang teacher has no snapshot


def test_mixture_route_weights_label_and_target():
    panel = TeacherPanel.from_config(
        {"a": {"mode": "megatron", "model": "x", "opd_kl_coef": 1.0},
         "b": {"mode": "megatron", "model": "y", "opd_kl_coef": 0.0}},
        default_coef=0.5, mixtures={"math": {"a": 1.0, "b": 3.0}},
    )  # fmt: skip
    r = panel.route(_sample("math"))
    assert r.weights == (("a", 0.25), ("b", 0.75)) and r.label == "0.25*a+0.75*b"
    assert panel.coef(r) == pytest.approx(0.25)
    qa, qb = torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -3.0])
    want = torch.log(0.25 * qa.exp() + 0.75 * qb.exp())
    assert torch.allclose(mix_logprobs(r, {"a": qa, "b": qb}), want)
    assert torch.equal(mix_logprobs(Route((("a", 1.0),)), {"a": qa}), qa)
    assert math.isclose(sum(w for _, w in r.weights), 1.0)


def test_routing_by_import_path():
    panel = TeacherPanel.from_config(PANEL, 0.5, routing=f"{__name__}:route_by_length")
    assert panel.route(_sample("anything")).label == "words"
    short = _sample("x")
    short.tokens, short.prompt_len, short.loss_mask = [1, 2], 2, []
    short.rollout_logprobs, short.weight_versions = [], []
    with pytest.raises(ValueError, match="share a granularity"):  # math is topk, words sampled
        panel.route(short)


@pytest.mark.parametrize(
    ("teachers", "extra", "message"),
    [
        ({"t": {"mode": "cloud"}}, {}, r"teachers.t.mode must be"),
        ({"t": {"mode": "megatron"}}, {}, r"teachers.t.model is required"),
        ({"t": {"mode": "sglang", "urls": ["u"], "granularity": "full"}}, {}, "needs mode 'megatron'"),
        ({"t": {"mode": "megatron", "model": "x", "granularity": "top"}}, {}, "teachers.t.granularity"),
        ({"t": {"mode": "megatron", "model": "x", "colour": 1}}, {}, r"unknown keys \['colour'\]"),
        (
            {"t": {"mode": "megatron", "model": "x"}},
            {"teacher_mixtures": {"m": {"u": 1.0}}},
            "unknown teachers",
        ),
        ({"t": {"mode": "megatron", "model": "x"}}, {"teacher_routing": "nope"}, "teacher_routing must be"),
        (
            {"t": {"mode": "megatron", "model": "x"}},
            {"teacher_mode": "megatron", "teacher_model": "x"},
            "not both",
        ),
    ],
)
def test_bad_panels_name_the_field(teachers, extra, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(opd=OpdOptions(kl_coef=0.5, teachers=teachers, **extra))


def test_single_teacher_config_is_a_one_teacher_panel():
    cfg = TrainerConfig(
        opd=OpdOptions(kl_coef=0.3, teacher_mode="megatron", teacher_model="tiny", granularity="full")
    )
    panel = cfg.opd.panel()
    assert panel is not None and panel.names == ["teacher"] and cfg.opd.enabled
    assert panel.specs["teacher"].granularity == "full" and panel.specs["teacher"].opd_kl_coef == 0.3
    assert panel.route(_sample("whatever")).label == "teacher"
    assert TrainerConfig().opd.panel() is None and not TrainerConfig().opd.enabled
    assert TrainerConfig.from_dict(cfg.to_dict()) == cfg


def test_math_routing_by_task_kind():
    panel = TeacherPanel.from_config(
        {
            "arithmetic": {"mode": "megatron", "model": "x"},
            "worked_steps": {"mode": "megatron", "model": "y"},
        },
        default_coef=1.0,
        routing="palaestra.environments.math.routing:by_kind",
    )
    s = _sample("math")
    for task_id, teacher in (("arithmetic-d0-s1-3", "arithmetic"), ("worked_steps-d0-s1-4", "worked_steps")):
        s.task_id = task_id
        assert panel.route(s).label == teacher
    s.task_id = "fraction-d2-s1-5"
    with pytest.raises(ValueError, match="no teacher for math task kind 'fraction'"):
        panel.route(s)
