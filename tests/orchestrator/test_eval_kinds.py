"""Held-out scoring per task kind (`sdk.scoring.score`, used by `palaestra eval` and by training's
evaluations) and its metrics row (`loop.eval_row`)."""

from __future__ import annotations

from palaestra.environments.math.tasks import generate_tasks
from palaestra.orchestrator.loop import eval_row
from palaestra.sdk.runner import RolloutResult
from palaestra.sdk.scoring import score


def _result(task_id: str, correct: float, status: str = "completed") -> RolloutResult:
    return RolloutResult(task_id, "g", "s", correct, status, {"correct": correct})


def test_one_kind_gives_the_overall_accuracy_only():
    tasks = generate_tasks(4, seed=3, difficulty=0, kinds=["arithmetic"])
    results = [_result(t.task_id, float(i % 2)) for i, t in enumerate(tasks)]
    out = score(tasks, results)
    assert out == {"accuracy": 0.5, "tasks": 4.0, "failed": 0.0}
    assert eval_row(out) == {"eval/accuracy": 0.5}


def test_two_kinds_are_scored_apart_and_failures_left_out():
    arith = generate_tasks(4, seed=3, difficulty=0, kinds=["arithmetic"])
    steps = generate_tasks(2, seed=3, difficulty=0, kinds=["worked_steps"])
    results = [_result(t.task_id, 1.0) for t in arith[:3]] + [_result(arith[3].task_id, 0.0, "failed")]
    results += [_result(steps[0].task_id, 0.0), _result(steps[1].task_id, 1.0)]
    out = score([*arith, *steps], results)
    assert out["accuracy"] == 4 / 5 and out["failed"] == 1.0
    assert out["accuracy/arithmetic"] == 1.0 and out["tasks/arithmetic"] == 3.0
    assert out["accuracy/worked_steps"] == 0.5 and out["tasks/worked_steps"] == 2.0
    assert eval_row(out) == {
        "eval/accuracy": 0.8,
        "eval/accuracy/arithmetic": 1.0,
        "eval/accuracy/worked_steps": 0.5,
    }


def test_eval_cli_reports_each_kinds_accuracy_as_training_does(tok, tmp_path):
    """`palaestra eval` on tasks of three kinds prints (and puts in --json) each kind's accuracy
    with its interval, from the same scoring as training. The model is a SCRIPTED ENGINE (a
    labelled TEST DOUBLE from tests/support/servers.py) that answers the arithmetic tasks right and
    the others wrong; the gateway and the CLI are real."""
    import json
    import os
    import subprocess
    import sys

    from palaestra.environments.math.env import MathEnv
    from palaestra.sdk.runner import take_tasks
    from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

    end = tok.convert_tokens_to_ids("<|im_end|>")
    tasks = take_tasks(MathEnv(), 6, seed=0)
    assert {t.kind for t in tasks} == {"arithmetic", "word_problem", "fraction"}

    def answer(ids, _):
        prompt = tok.decode(ids)
        task = next(t for t in tasks if t.question in prompt)
        value = task.answer if task.kind == "arithmetic" else "-1"
        return tok.encode(f"\\boxed{{{value}}}", add_special_tokens=False) + [end]

    engine = ScriptedEngine(answer, stop_ids={end})
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path, tok, api_key="k-eval") as gw:
            r = subprocess.run(
                [sys.executable, "-m", "palaestra.cli", "eval", "--env", "math", "--gateway", gw.url]
                + ["--tasks", "6", "--quiet", "--json"],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PALAESTRA_API_KEY": "k-eval"},
            )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("accuracy 0.333 ") and "on 6 tasks (0 failed)" in lines[0], r.stdout
    assert "  arithmetic: accuracy 1.000 ± 0.000 s.e. (95% CI " in r.stdout and "on 2 tasks" in r.stdout
    # 1.000 vs 0.000 on 2 tasks each is within two standard errors of their difference: said so
    assert (
        "  note: arithmetic (1.000) and fraction (0.000) differ by less than two standard errors" in r.stdout
    )
    assert "  fraction: accuracy 0.000 " in r.stdout and "  word_problem: accuracy 0.000 " in r.stdout
    result = json.loads(lines[-1])
    assert result["n"] == 6 and abs(result["accuracy"] - 1 / 3) < 1e-9
    assert set(result["kinds"]) == {"arithmetic", "fraction", "word_problem"}
    arithmetic = result["kinds"]["arithmetic"]
    assert arithmetic["accuracy"] == 1.0 and arithmetic["n"] == 2 and 0.3 < arithmetic["ci95"][0] < 1.0
