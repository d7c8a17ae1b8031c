"""The reasoning-gym family: every dataset builds tasks and scores its own reference answers at 1.0,
rollouts through the real gateway score right and wrong answers, per-dataset accuracy, and the
errors a run's config gets at load for an unknown or broken dataset.

The model in the rollouts is a SCRIPTED ENGINE (a labelled TEST DOUBLE, tests/support/servers.py):
it reads the question from the prompt's token ids and answers with the dataset's reference answer
(the correct agent) or a wrong one; the gateway, its rendering and the openai client are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is an extra: make install installs it")

from palaestra.environments.reasoning_gym.env import (  # noqa: E402
    DatasetError,
    ReasoningGymEnv,
    build_dataset,
    dataset_names,
)
from palaestra.sdk import GatewayClient, run_rollouts  # noqa: E402
from palaestra.sdk.scoring import score  # noqa: E402
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server  # noqa: E402

# Datasets whose items carry no reference answer (`answer` is None): rubiks_cube,
# propositional_logic and graph_color keep an example answer in their metadata, which is scored
# instead. These hold none at all: any valid solution scores, checked by simulating it, so for them
# a wrong answer must score below 1 instead.
NO_REFERENCE = {
    "boxnet": "any plan that moves every box to its goal scores; the item holds no plan",
    "rush_hour": "any move sequence that frees the car scores; the item holds no solution",
}
EXAMPLE_KEYS = ("possible_answer", "example_answer", "example_correct_answer")
COMPOSITE = {
    "datasets": [
        {"name": "chain_sum", "weight": 1, "config": {}},
        {"name": "spell_backward", "weight": 1, "config": {}},
    ]
}


def reference(entry) -> str | None:
    if entry["answer"] is not None:
        return entry["answer"]
    for key in EXAMPLE_KEYS:
        if key in entry["metadata"]:
            value = entry["metadata"][key]
            return value if isinstance(value, str) else json.dumps(value)
    return None


def test_every_dataset_builds_tasks_and_scores_its_reference_answers():
    """All 106 datasets with their default configs: one item each (seed 1; seed 0's first
    knight_swap and quantum_lock puzzles take seconds to search), its reference answer scored 1.0
    by the dataset's own score_answer. Prints the seconds it took (the slowest datasets first)."""
    names = dataset_names()
    assert len(names) == 106
    took, failures = {}, []
    for name in names:
        t0 = time.perf_counter()
        ds = build_dataset(name, COMPOSITE if name == "composite" else {}, seed=1, size=1)
        entry = ds[0]
        answer = reference(entry)
        if name in NO_REFERENCE:
            assert answer is None, f"{name} now ships a reference answer: score it"
            if ds.score_answer("not a plan", entry) >= 1.0:
                failures.append(f"{name}: a wrong answer scored 1")
        elif answer is None or ds.score_answer(answer, entry) != 1.0:
            failures.append(f"{name}: reference {answer!r} scored {ds.score_answer(answer, entry)}")
        took[name] = time.perf_counter() - t0
    slowest = sorted(took.items(), key=lambda kv: -kv[1])[:5]
    print(f"{len(names)} datasets in {sum(took.values()):.1f} s; slowest: {slowest}")
    assert not failures, failures


def test_tasks_are_reproducible_weighted_and_another_seed_holds_others_out():
    env = ReasoningGymEnv({"chain_sum": {"weight": 3}, "spell_backward": {}}, size=50)
    first = [t.task_id for t in itertools.islice(env.tasks(0), 40)]
    assert first == [t.task_id for t in itertools.islice(env.tasks(0), 40)]
    kinds = [t.split("-s")[0] for t in first]
    assert 20 < kinds.count("chain_sum") < 40 and "spell_backward" in kinds
    held_out = {t.question for t in itertools.islice(env.tasks(1), 40)}
    assert held_out != {t.question for t in itertools.islice(env.tasks(0), 40)}


@pytest.mark.parametrize(
    ("datasets", "needle"),
    [
        (["no_such_dataset"], "the datasets are: ab, acre"),
        ({"chain_sum": {"config": {"min_terms": 9, "max_terms": 2}}}, "'chain_sum' could not be built"),
        ({"chain_sum": {"config": {"bogus": 1}}}, "unexpected keyword argument 'bogus'"),
        ({"chain_sum": {"weight": -1}}, "datasets.chain_sum.weight"),
    ],
)
def test_bad_datasets_are_named_when_the_run_config_loads(tmp_path, datasets, needle):
    from palaestra.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"env": {"name": "reasoning-gym", "args": {"datasets": datasets}}}))
    with pytest.raises(ConfigError, match="env.args") as err:
        load_config(str(path), [])
    assert needle in str(err.value)
    with pytest.raises(DatasetError):
        ReasoningGymEnv(datasets)


def answering(tok, tasks, right: bool) -> ScriptedEngine:
    """A scripted engine that finds which task's question is in the prompt and answers it."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = {t.question: reference(t.entry) for t in tasks}

    def script(ids, index):
        prompt = tok.decode(ids)
        answer = next(a for q, a in answers.items() if q in prompt)
        text = f"<answer>{answer}</answer>" if right else "I do not know."  # no answer tag: reward 0
        return tok.encode(text, add_special_tokens=False) + [end]

    return ScriptedEngine(script, stop_ids={end})


@pytest.mark.parametrize("right", [True, False], ids=["correct-agent", "wrong-agent"])
def test_rollouts_through_the_gateway_score_with_the_datasets_own_score_answer(tok, tmp_path, right):
    env = ReasoningGymEnv(["spell_backward", "number_sorting", "chain_sum"], size=20, max_tokens=64)
    tasks = list(itertools.islice(env.tasks(3), 6))
    with ThreadServer(answering(tok, tasks, right).app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok, api_key="k") as gw:

            async def run():
                client = GatewayClient(gw.url, "k")
                try:
                    return await run_rollouts(env, client, tasks, samples_per_task=2, progress=False)
                finally:
                    await client.close()

            summary = asyncio.run(run())
    assert summary.statuses == {"completed": 12}
    assert summary.rewards == [1.0 if right else 0.0] * 12
    scores = score(tasks, summary.results)
    kinds = {t.kind for t in tasks}
    assert len(kinds) > 1 and all(scores[f"accuracy/{k}"] == (1.0 if right else 0.0) for k in kinds)
    assert all(r.metrics["answered"] == float(right) for r in summary.results)


def test_importing_the_family_silences_cellpylibs_syntax_warnings_only():
    # cellpylib's sources warn when compiled (a fresh install has no .pyc yet); the family's import
    # filters exactly those: the same source under another file name still warns.
    import subprocess
    import sys

    script = (
        "import warnings, pathlib, cellpylib\n"
        "import palaestra.environments.reasoning_gym.env\n"
        "src = pathlib.Path(cellpylib.__file__).with_name('ca_functions.py')\n"
        "with warnings.catch_warnings(record=True) as got:\n"
        "    compile(src.read_text(), str(src), 'exec')\n"
        "    own = len(got)\n"
        "    compile(src.read_text(), '/elsewhere/ca_functions.py', 'exec')\n"
        "print(own, [w.category.__name__ for w in got[own:]])\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    own, elsewhere = out.stdout.strip().split(" ", 1)
    assert own == "0", out
    assert elsewhere == "['SyntaxWarning', 'SyntaxWarning']", out
