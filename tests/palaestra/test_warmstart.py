"""The demo's warm start: the `sft` estimator, the SFT chats, and the exported model in an engine.

CI-sized: a handful of chats and a few steps (the real recipe is
`palaestra.environments.math.warmstart.RECIPES`, measured in its module docstring).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from palaestra.environments.math.env import SYSTEM
from palaestra.environments.math.warmstart import (
    answer_text,
    demo_tasks,
    prompt_messages,
    sft_sample,
    warm_start,
)
from palaestra.gateway.renderer import ChatRenderer, normalize_messages
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer import advantages as adv
from palaestra.trainer.packing import build_micro_batch
from palaestra.verifiers.math import verify_math


def test_sft_chat_is_the_environment_prompt_plus_the_answer(tok):
    from palaestra.environments.math.env import MathEnv

    tasks = demo_tasks(6, seed=0)
    assert demo_tasks(3, seed=0) == tasks[:3]  # task i depends on (seed, i) only
    renderer = ChatRenderer(tok)
    for i, task in enumerate(tasks):
        assert prompt_messages(task) == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task.question},
        ]
        sample = sft_sample(tok, task, i)
        # the prompt is what the gateway renders for the environment's request
        gateway_prompt = renderer.encode(renderer.render(normalize_messages(prompt_messages(task)), None))
        assert sample.tokens[: sample.prompt_len] == gateway_prompt
        response = sample.tokens[sample.prompt_len :]
        assert response[-1] == tok.eos_token_id and sample.loss_mask == [1] * len(response)
        text = tok.decode(response, skip_special_tokens=True)
        assert text == answer_text(task) and verify_math(text, task.answer).correct
    # the environment serves the same distribution: its difficulty-0 arithmetic stream
    stream = MathEnv(difficulty=0, kinds=["arithmetic"]).tasks(seed=0)
    assert [next(iter(stream)) for _ in range(6)] == tasks
    assert all(t.difficulty == 0 and t.kind == "arithmetic" for t in tasks)
    assert {t.question.split()[-2] for t in demo_tasks(200, seed=3)} == {"+", "-"}


def test_sft_estimator_is_one_per_sample():
    assert torch.equal(adv.sft(3), torch.ones(3))
    assert TrainerConfig(advantage_estimator="sft").advantage_estimator == "sft"


def test_sft_steps_lower_the_loss_and_raise_the_answer_probability(tok, tiny_model_dir):
    samples = [sft_sample(tok, t, i) for i, t in enumerate(demo_tasks(8, seed=1))]
    trainer = Trainer(
        TrainerConfig(advantage_estimator="sft", megatron_optimizer={"lr": 1e-3}, seed=0), tiny_model_dir
    )

    def answer_logprobs() -> torch.Tensor:
        return trainer.logprobs([build_micro_batch(samples, range(len(samples)))])[0]

    before = answer_logprobs()
    nll = [trainer.step(samples)["train/nll"] for _ in range(8)]
    after = answer_logprobs()
    # train/nll is the pre-update NLL of the batch: the first equals the model's own
    assert nll[0] == pytest.approx(-before.mean().item(), rel=1e-4)
    assert nll[-1] < 0.5 * nll[0], nll
    assert after.mean() > before.mean() + 1.0
    assert after.exp().mean() > 2 * before.exp().mean()  # probability of the answer tokens


@pytest.mark.engine
def test_warm_start_exports_a_model_the_engine_serves(tmp_path, tok):
    from palaestra.engine.cli import engine_process

    lines: list[str] = []
    path = warm_start("student", cache_dir=tmp_path, steps=2, progress=lines.append)
    assert path.name == "demo-student-v2-2steps" and path.parent == tmp_path / "models"
    marker = json.loads((path / "palaestra_preset.json").read_text())
    assert marker["recipe"]["steps"] == 2 and marker["name"] == "demo-student"
    assert any("step    2/2" in line for line in lines)
    assert not (tmp_path / "models" / "demo-student-v2").exists()  # a test size never fills the real slot
    # cached: a second call trains nothing
    again: list[str] = []
    assert warm_start("student", cache_dir=tmp_path, steps=2, progress=again.append) == path and not again

    task = demo_tasks(1, seed=5)[0]
    prompt = sft_sample(tok, task).tokens[: sft_sample(tok, task).prompt_len]
    with engine_process(str(path), extra_args=["--num-threads", "1"]) as engine:
        r = httpx.post(
            f"{engine.url}/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=60,
            trust_env=False,
        )
        assert r.status_code == 200, r.text
        assert 1 <= len(r.json()["output_ids"]) <= 4


def test_demo_presets_build_teacher_and_student_in_one_run(tmp_path, monkeypatch, capsys):
    """`demo-student` and `demo-teacher` are presets; asking for the student first runs the
    teacher's recipe once and exports the student at its step on the way (recipes shrunk to 4 and
    2 steps here; the schedule and everything else as in the real ones)."""
    from palaestra.environments.math import warmstart
    from palaestra.models import PRESETS, resolve_model

    assert {"demo-teacher", "demo-student"} <= set(PRESETS)
    small = {
        k: warmstart.SFTRecipe(**{**asdict(r), "steps": n})
        for (k, r), n in zip(warmstart.RECIPES.items(), (4, 2, 4, 2, 2, 4, 2, 3, 2), strict=True)
    }
    monkeypatch.setattr(warmstart, "RECIPES", small)
    student = resolve_model("demo-student", cache_dir=tmp_path)
    teacher = resolve_model("demo-teacher", cache_dir=tmp_path)
    assert (
        student.name == f"demo-student-v{warmstart.VERSION}"
        and teacher.name == f"demo-teacher-v{warmstart.VERSION}"
    )
    assert json.loads((student / "palaestra_preset.json").read_text())["recipe"]["steps"] == 2
    assert json.loads((teacher / "palaestra_preset.json").read_text())["recipe"]["steps"] == 4
    lines = capsys.readouterr().out.splitlines()
    runs = [line for line in lines if line.startswith("warm start: training")]
    assert len(runs) == 1 and "teacher" in runs[0], lines  # one SFT run built both
    s = AutoModelForCausalLM.from_pretrained(student).state_dict()
    t = AutoModelForCausalLM.from_pretrained(teacher).state_dict()
    assert any(not torch.equal(s[k], t[k]) for k in s)  # two more steps moved the teacher


def test_moe_pair_is_the_demo_recipe_on_the_moe_preset():
    """`demo-moe-teacher`/`demo-moe-student`: the demo pair's recipes with only the base preset
    changed, registered as warm-start presets, the student again the teacher's run stopped early."""
    from palaestra.environments.math import warmstart
    from palaestra.models import PRESETS

    recipes = warmstart.RECIPES
    for kind in ("teacher", "student"):
        assert PRESETS[f"demo-moe-{kind}"].recipe == PRESETS[f"demo-{kind}"].recipe
        assert recipes[f"moe-{kind}"] == warmstart.SFTRecipe(**{**asdict(recipes[kind]), "base": "tiny-moe"})
        assert recipes[kind].base == "tiny"
    assert recipes["moe-teacher"].steps == 600 and recipes["moe-student"].steps == 300
    assert warmstart._student_is_teacher_prefix("moe-student")


def test_moe_pair_builds_from_the_moe_preset_in_one_run(tmp_path, monkeypatch, capsys):
    """Asking for the MoE student runs the MoE teacher's recipe once (shrunk to 2 and 1 steps) from
    `tiny-moe` and exports a Qwen3-MoE model at both steps."""
    from palaestra.environments.math import warmstart
    from palaestra.models import resolve_model

    small = dict(warmstart.RECIPES)
    small["moe-teacher"] = warmstart.SFTRecipe(**{**asdict(small["moe-teacher"]), "steps": 2})
    small["moe-student"] = warmstart.SFTRecipe(**{**asdict(small["moe-student"]), "steps": 1})
    monkeypatch.setattr(warmstart, "RECIPES", small)
    student = resolve_model("demo-moe-student", cache_dir=tmp_path)
    teacher = resolve_model("demo-moe-teacher", cache_dir=tmp_path)
    assert student.name == f"demo-moe-student-v{warmstart.VERSION}"
    for path, steps in ((student, 1), (teacher, 2)):
        marker = json.loads((path / "palaestra_preset.json").read_text())
        assert marker["base"] == "tiny-moe" and marker["recipe"]["steps"] == steps
        assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warm start: training")]
    assert len(runs) == 1 and "moe-teacher" in runs[0], runs
