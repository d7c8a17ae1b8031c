"""An answer the scorer cannot parse scores 0 and is recorded (``failure/unparseable_answer``), in
every family, instead of failing the episode (a failed episode is never trained on, so the policy
would never be penalised for a garbage answer); and reasoning-gym's held-out tasks are the same in
every process whatever its PYTHONHASHSEED (issue 37, "the ecosystem families").

The model's reply is given directly (`Replying`, a TEST DOUBLE of a session whose client answers
with a fixed text); the environments, their scorers and verifiers are real. TextArena's garbage
move goes through the real gateway (tests/environments/test_textarena.py's scripted engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from palaestra.environments.judged.env import JudgedMathEnv
from palaestra.environments.math.env import MathEnv
from palaestra.sdk.runner import take_tasks

GARBAGE = "The answer is \\boxed{@@ ?? @@}. <answer>banana</answer>"


class Replying:
    """TEST DOUBLE of a `Session`: every chat call answers `text`."""

    sampling: dict = {}
    session_id = "s-test"

    def __init__(self, text: str):
        async def create(**_):
            message = SimpleNamespace(content=text, tool_calls=None)
            return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")])

        self.client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def rollout(env, task, text=GARBAGE):
    return asyncio.run(env.rollout(Replying(text), task))


@pytest.mark.parametrize("env", [MathEnv(), JudgedMathEnv(judge=None)], ids=["math", "judged-math"])
def test_math_families_score_an_unparseable_answer_0_and_say_so(env):
    task = take_tasks(env, 1, 0)[0]
    reward = rollout(env, task)
    assert reward.value == 0.0 and reward.metrics["failure/unparseable_answer"] == 1.0
    right = rollout(env, task, f"\\boxed{{{task.answer}}}")
    assert right.value == 1.0 and right.metrics["failure/unparseable_answer"] == 0.0


def test_reasoning_gym_scores_what_its_scorer_raises_on_as_0():
    pytest.importorskip("reasoning_gym")
    from palaestra.environments.reasoning_gym.env import ReasoningGymEnv

    env = ReasoningGymEnv(["prime_factorization"], size=4)
    task = take_tasks(env, 1, 0)[0]
    with pytest.raises(ValueError):  # what the dataset's own scorer does with it
        env._built[(task.kind, task.seed)].score_answer("banana", task.entry)
    reward = rollout(env, task)
    assert reward.value == 0.0 and reward.metrics["failure/unparseable_answer"] == 1.0
    right = rollout(env, task, f"<answer>{task.entry['answer']}</answer>")
    assert right.value == 1.0 and right.metrics["failure/unparseable_answer"] == 0.0


def test_a_mix_passes_its_members_unparseable_answers_on():
    pytest.importorskip("reasoning_gym")
    from palaestra.environments.mix.env import MixEnv

    env = MixEnv({"reasoning-gym": {"args": {"datasets": ["prime_factorization"], "size": 4}}, "math": {}})
    for task in take_tasks(env, 4, 0):
        reward = rollout(env, task)
        assert reward.value == 0.0 and reward.metrics["failure/unparseable_answer"] == 1.0, task.task_id


def test_textarena_scores_a_move_it_cannot_read_0_and_says_so(tok, tmp_path):
    pytest.importorskip("textarena")
    from palaestra.environments.textarena.env import TextArenaEnv
    from tests.environments.test_textarena import rollouts

    env = TextArenaEnv(["GuessTheNumber-v0"], max_turns=4)
    summary, _ = rollouts(tok, tmp_path, env, take_tasks(env, 1, 0), lambda p, i: "no move here")
    (result,) = summary.results
    assert result.status == "completed", result.error
    assert result.reward == 0.0 and result.metrics["failure/unparseable_answer"] == 1.0


EVAL_SET = """
import json, warnings
warnings.simplefilter("ignore")
from palaestra.environments.reasoning_gym.env import ReasoningGymEnv, HASH_SEEDED
from palaestra.sdk.runner import stratified_tasks
env = ReasoningGymEnv(sorted(HASH_SEEDED) + ["chain_sum"], size=40)
print(json.dumps([[t.task_id, t.question, str(t.entry["answer"])] for t in stratified_tasks(env, 8, 1)]))
"""


@pytest.mark.slow  # two processes, each generating three datasets' items in a child (~30 s)
def test_the_reasoning_gym_eval_set_is_the_same_whatever_the_hash_seed():
    """The held-out set (seed 1) built in two processes with different PYTHONHASHSEED: the same
    tasks, questions and answers, the hash-seeded datasets' among them."""
    pytest.importorskip("reasoning_gym")
    sets = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", EVAL_SET], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        sets.append(json.loads(out.stdout))
    assert {t[0].split("-s")[0] for t in sets[0]} == {
        "isomorphic_strings",
        "polynomial_multiplication",
        "ransom_note",
        "chain_sum",
    }
    assert sets[0] == sets[1]
