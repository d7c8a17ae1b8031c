"""Warm starts for the demo: a strong teacher and a weak student, by SFT with the trainer itself.

    python -m palaestra.environments.math.warmstart teacher  # prints the HF directory (built once, then cached)
    palaestra model build demo-teacher                        # the same, as a preset
    palaestra train configs/demo.yaml        # model.student: demo-student, model.teacher: demo-teacher

Both start from the `tiny` preset (random weights; the MoE pair below from `tiny-moe`) and are trained by `palaestra.trainer.Trainer`
with ``advantage_estimator="sft"`` (advantage 1 on every answer token: the NLL gradient) on chats
rendered exactly as the math environment renders its prompts -- `SYSTEM`, then the task's question
-- followed by the answer in the form the verifier accepts (``\\boxed{8}``). The only difference
between this data and the RL prompts is that the answer is given.

The tasks are the math generator's difficulty 0 (``x + y`` / ``x - y``, x and y in 0..9; the
environment serves them with ``MathEnv(difficulty=0, kinds=["arithmetic"])``). Why not difficulty
1 (two-digit operands): measured on the 2-core machine, a randomly initialised 4M-parameter model
learns to copy the expression in ~600 steps of 16 but is still at 8 % exact answers after 3000
steps (~11 min), far past the demo's budget. Greedy accuracy on 200 held-out tasks along the
teacher's run (one run, 2 cores, 0.19 s per step):

    step      50    100   150   200   250   300   350   400   450   500   550   600
    accuracy  0.04  0.08  0.12  0.16  0.22  0.28  0.48  0.76  0.78  0.90  0.98  0.98

The problem space is 200 problems in 4 phrasings, so every split covers it: "held-out" accuracy
is measured on fresh tasks (another seed) of the same distribution, not on unseen problems.

The student is the teacher's own run stopped at step 300 (same seed, data order and learning-rate
schedule): weak (0.28 here, 0.34 on the training run's held-out tasks), but with reward variance
for GRPO and a teacher to distil from. Building
the teacher exports the student on the way when it is not cached yet, so both cost one run.
Directories live in ``<cache>/models/demo-{teacher,student}-v<VERSION>`` (the preset table,
`palaestra.models.PRESETS`, names them ``demo-teacher`` and ``demo-student``), built under a lock
into a temporary directory and renamed into place by the cache's `build_once`, like every preset.

The same recipes from the Qwen3-MoE preset (`SFTRecipe.base` ``tiny-moe``: 3M parameters, 8
experts, top-2) give ``demo-moe-teacher`` and ``demo-moe-student`` (configs/moe.yaml). Measured once
on the 2-core machine (load average 4-9 from other work, OMP_NUM_THREADS=1): the teacher's 600
steps took 212 s (0.35 s per step; nll per answer token 0.10 over its last 50 steps), the student
exported at step 300 on the way. Greedy accuracy on 200 held-out tasks (seed 2024), beside the
dense pair on the same tasks:

    model      demo-moe-teacher  demo-moe-student  demo-teacher  demo-student
    accuracy   0.985             0.230             0.950         0.260

The worked-steps pair (``demo-steps-teacher``, 1,500 steps; ``demo-steps-student``, its step 400)
has a third member, ``demo-steps-student-rl``: the same run stopped at step 600, the first stop
measured in 0.2-0.4 greedy held-out accuracy (0.050 at step 400, 0.135 at 500, 0.270 at 600; 200
tasks), so that groups of 8 mostly have reward variance and GRPO has something to learn from.
The two-domain bench's student, ``demo-mixed-student-rl``, is its own run: 800 steps of three
worked-steps tasks to one sum (0.515 on sums and 0.270 on worked steps, greedy, 200 held-out tasks
each; ``demo-mixed-student``, 300 steps of both kinds in turn, was 0.110 / 0.040, too weak on worked
steps for RL to move it).

Determinism: fixed seeds and data order; on CPU the result also depends on torch's thread count
(matmul blocking), so another machine builds a statistically equal, not bit-identical, model.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast

from palaestra.environments.math.env import SYSTEM
from palaestra.environments.math.tasks import MathTask, generate_tasks
from palaestra.models.cache import build_once, is_built, models_dir, write_marker
from palaestra.sample import Sample

__all__ = [
    "RECIPES",
    "VERSION",
    "SFTRecipe",
    "answer_text",
    "demo_tasks",
    "prompt_messages",
    "resolve",
    "sft_sample",
    "train_sft",
    "warm_start",
]

# Bump whenever a recipe, the task distribution or the answer format changes: the cache directory
# carries it, so a stale build is never reused.
VERSION = 2

Kind = Literal[
    "teacher",
    "student",
    "steps-teacher",
    "steps-student",
    "mixed-student",
    "moe-teacher",
    "moe-student",
    "steps-student-rl",
    "mixed-student-rl",
]


@dataclass(frozen=True)
class SFTRecipe:
    """One SFT run from a base preset; every field is part of the cached model's identity."""

    steps: int
    """Optimizer steps (one `Trainer.step` each) before the model is exported."""

    batch_size: int = 16
    """Chats per step. Small batches, many steps: measured faster per CPU-second than 64."""

    lr: float = 1e-3
    """Peak learning rate (Adam). Measured: 1e-3 reaches 98 % in 600 steps; 3e-3 stalls near
    50 % and varies a lot with the data order; 1e-2 collapses."""

    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""

    warmup_steps: int = 50
    """Linear warm-up from 0 (without it the first steps blow up: grad norm ~100 at step 7)."""

    decay_steps: int = 600
    """Length of the cosine decay (Megatron's `OptimizerParamScheduler`). The student shares the
    teacher's schedule, so it is exactly the teacher's run stopped at its `steps`."""

    data_seed: int = 1000
    """Seed of the training task stream (evaluation uses other seeds)."""

    seed: int = 1234
    """`TrainerConfig.seed` (torch's generators)."""

    kinds: tuple[str, ...] = ("arithmetic",)
    """Math task kinds at difficulty 0: ``arithmetic`` (the demo's sums) or ``worked_steps`` (answers
    written out one line per step, for OPD vs GRPO: docs/opd.md)."""

    base: str = "tiny"
    """The preset the run starts from (random weights): ``tiny`` (dense) or ``tiny-moe``."""


RECIPES: dict[str, SFTRecipe] = {
    "teacher": SFTRecipe(steps=600),
    "student": SFTRecipe(steps=300),
    # worked steps: answers of 23-29 tokens, learnt more slowly; the student is again the
    # teacher's run stopped early (not measured to convergence yet: see docs/opd.md)
    "steps-teacher": SFTRecipe(steps=1500, decay_steps=1500, kinds=("worked_steps",)),
    "steps-student": SFTRecipe(steps=400, decay_steps=1500, kinds=("worked_steps",)),
    # both kinds in turn (8 of each per step), stopped early: the two-domain run's student
    # (bench/two_domains.py), weak on both so that each domain's teacher has something to teach
    "mixed-student": SFTRecipe(steps=300, decay_steps=1500, kinds=("arithmetic", "worked_steps")),
    # the demo pair's recipe on the Qwen3-MoE preset (configs/moe.yaml)
    "moe-teacher": SFTRecipe(steps=600, base="tiny-moe"),
    "moe-student": SFTRecipe(steps=300, base="tiny-moe"),
    # the steps teacher's run stopped later, where RL can learn (bench/opd_vs_grpo.py --task
    # worked_steps_rl): greedy held-out accuracy 0.050 at step 400, 0.135 at 500, 0.270 at 600
    # (200 tasks, seed 1000003: the runs' held-out set); 600 is the first stop in 0.2-0.4
    "steps-student-rl": SFTRecipe(steps=600, decay_steps=1500, kinds=("worked_steps",)),
    # the two-domain student RL can move on both kinds (bench/two_domains.py): three worked_steps
    # tasks to one sum per step, since sums are learnt about 3x faster; greedy held-out accuracy
    # (arithmetic / worked_steps, 200 tasks each, the runs' held-out seed) along one run:
    # step 600 0.365 / 0.060, 700 0.485 / 0.170, 800 0.515 / 0.270, 900 0.770 / 0.365,
    # 1000 0.830 / 0.440; 800 is the one stop with both kinds in 0.25-0.55
    "mixed-student-rl": SFTRecipe(
        steps=800, decay_steps=1500, kinds=("worked_steps", "worked_steps", "worked_steps", "arithmetic")
    ),
}
_PAIRS = {
    "student": "teacher",
    "steps-student": "steps-teacher",
    "moe-student": "moe-teacher",
    "steps-student-rl": "steps-teacher",
}  # student -> the run it stops early


# ----------------------------------------------------------------------------------------------
# Tasks and chats
# ----------------------------------------------------------------------------------------------
def demo_tasks(n: int, seed: int, kinds: tuple[str, ...] = ("arithmetic",)) -> list[MathTask]:
    """The first `n` tasks of the math environment's difficulty-0 stream for `seed` and `kinds`
    (``MathEnv(difficulty=0, kinds=["arithmetic"])``: ``x + y`` / ``x - y`` with x, y in 0..9)."""
    return generate_tasks(n, seed, difficulty=0, kinds=kinds)


def prompt_messages(task: MathTask) -> list[dict[str, str]]:
    """The math environment's request messages for `task` (environments/math/env.py)."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]


def answer_text(task: MathTask) -> str:
    """The assistant's answer: what `verify_math` accepts (with the worked solution when the task
    has one), and nothing else to learn."""
    return task.solution or f"\\boxed{{{task.answer}}}"


def _prompt_ids(tokenizer: Any, task: MathTask) -> list[int]:
    ids = tokenizer.apply_chat_template(prompt_messages(task), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sft_sample(tokenizer: Any, task: MathTask, index: int = 0) -> Sample:
    """The chat as the gateway would record it: the template's prompt, then the answer's tokens and
    the end-of-turn token (what the engine samples last), all with loss mask 1."""
    prompt = _prompt_ids(tokenizer, task)
    response = tokenizer.encode(answer_text(task), add_special_tokens=False) + [tokenizer.eos_token_id]
    sample = Sample(
        sample_id=f"sft-{index}",
        session_id=f"sft-{index}",
        group_id=f"sft-{index}",
        env="math-sft",
        task_id=task.task_id,
        tokens=prompt,
        prompt_len=len(prompt),
    )
    sample.append(response, sampled=True, logprobs=[0.0] * len(response))  # no rollout: logprobs unused
    return sample


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
Progress = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def train_sft(
    recipe: SFTRecipe,
    export: dict[int, Callable[[Any], None]],
    *,
    progress: Progress = _print,
    label: str = "sft",
    log_every: int = 50,
) -> list[dict[str, float]]:
    """Runs `recipe.steps` SFT steps; after step k calls ``export[k](trainer)`` if present.

    Returns the metrics of every step (``train/nll`` is the batch's NLL per answer token before
    the update).
    """
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model
    from palaestra.trainer import Trainer, TrainerConfig

    model_dir = resolve_model(recipe.base)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = TrainerConfig(
        seed=recipe.seed,
        advantage_estimator="sft",
        temperature=1.0,
        megatron_optimizer={"lr": recipe.lr, "min_lr": recipe.min_lr},
    )
    trainer = Trainer(config, model_dir)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # Megatron's own scheduler sets each param group's lr before every step (the trainer itself
    # keeps a constant one).
    scheduler = OptimizerParamScheduler(
        trainer.optimizer,
        init_lr=0.0,
        max_lr=recipe.lr,
        min_lr=recipe.min_lr,
        lr_warmup_steps=recipe.warmup_steps,
        lr_decay_steps=recipe.decay_steps,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=recipe.decay_steps,
        wd_incr_style="constant",
    )
    tasks = demo_tasks(recipe.steps * recipe.batch_size, recipe.data_seed, recipe.kinds)
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    window: list[float] = []
    for step in range(recipe.steps):
        batch = tasks[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        samples = [sft_sample(tokenizer, t, step * recipe.batch_size + i) for i, t in enumerate(batch)]
        metrics = trainer.step(samples)
        scheduler.step(1)
        history.append(metrics)
        window.append(metrics["train/nll"])
        done = step + 1
        if done % log_every == 0 or done == recipe.steps:
            elapsed = time.perf_counter() - started
            progress(
                f"  {label}: step {done:4d}/{recipe.steps}  nll/token {sum(window) / len(window):.3f}  "
                f"lr {metrics['train/lr']:.2e}  {elapsed:5.1f} s"
            )
            window = []
        if done in export:
            export[done](trainer)
    return history


def _target(kind: str, cache_dir: Path | None, steps: int | None) -> Path:
    suffix = "" if steps is None else f"-{steps}steps"
    return models_dir(cache_dir) / f"demo-{kind}-v{VERSION}{suffix}"


def _exporter(kind: str, recipe: SFTRecipe, target: Path, progress: Progress) -> Callable[[Any], None]:
    """Exports a trainer's weights to `target` atomically (the cache's lock-and-rename build)."""

    def export(trainer: Any) -> None:
        def build(tmp: Path) -> None:
            trainer.export_hf(tmp)
            write_marker(tmp, f"demo-{kind}", VERSION, base=recipe.base, recipe=asdict(recipe))

        build_once(target, build)
        progress(f"  {kind} ready: {target}")

    return export


def _student_is_teacher_prefix(student_kind: str = "student") -> bool:
    teacher, student = RECIPES[_PAIRS[student_kind]], RECIPES[student_kind]
    return student.steps < teacher.steps and asdict(student) == {**asdict(teacher), "steps": student.steps}


def warm_start(
    kind: Kind, cache_dir: str | Path | None = None, *, steps: int | None = None, progress: Progress = _print
) -> Path:
    """The HF directory of the demo's `kind` model, trained now if it is not cached.

    `steps` overrides the recipe's step count (tests; the learning-rate schedule is unchanged) and
    gets a cache directory of its own. The student is the teacher's run stopped early, so building
    either one when neither is cached runs the teacher's recipe once and exports both.
    """
    if kind not in RECIPES:
        raise ValueError(f"kind must be one of {sorted(RECIPES)}, got {kind!r}")
    cache = Path(cache_dir) if cache_dir is not None else None
    target = _target(kind, cache, steps)
    if is_built(target):
        return target
    recipe = RECIPES[kind]
    if kind in _PAIRS and steps is None and _student_is_teacher_prefix(kind):
        if not is_built(_target(_PAIRS[kind], cache, None)):
            warm_start(_PAIRS[kind], cache_dir, progress=progress)  # exports the student on the way
            if is_built(target):
                return target
    if steps is not None:
        recipe = SFTRecipe(**{**asdict(recipe), "steps": steps})
    exports = {recipe.steps: _exporter(kind, recipe, target, progress)}
    for student_kind, teacher_kind in _PAIRS.items():
        if kind != teacher_kind or steps is not None:
            continue
        student = _target(student_kind, cache, None)
        if _student_is_teacher_prefix(student_kind) and not is_built(student):
            exports[RECIPES[student_kind].steps] = _exporter(
                student_kind, RECIPES[student_kind], student, progress
            )
    progress(
        f"warm start: training the demo {kind} by SFT ({recipe.steps} steps of {recipe.batch_size} "
        f"{'/'.join(recipe.kinds)} tasks; cached afterwards)"
    )
    started = time.perf_counter()
    train_sft(recipe, exports, progress=progress, label=kind)
    progress(f"warm start: {kind} built in {time.perf_counter() - started:.0f} s")
    return target


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """``demo-<kind>`` (``demo-teacher``, ``demo-moe-student``, ...): `warm_start` of that kind (a
    `Preset` recipe)."""
    return warm_start(cast(Kind, name.removeprefix("demo-")), cache_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m palaestra.environments.math.warmstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("kind", choices=sorted(RECIPES), help="which model to build (or find in the cache)")
    ap.add_argument(
        "--cache-dir", default=None, help="cache root (default: $PALAESTRA_CACHE or ~/.cache/palaestra)"
    )
    args = ap.parse_args(argv)
    print(warm_start(args.kind, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
