"""`palaestra train` of a judge-rewarded environment (`--env judged-math`), sync and async, on Ray:
one step of the `tiny` preset whose rewards come from a judge, the `tiny` preset served by a second
engine of ours (`palaestra engine serve`, the `engine` fixture) called at its URL. The judge's calls
never become samples (the step trains exactly the policy's 2 tasks x 2 samples), every episode has
a verdict recorded (its session id, text and score or failure), and the judge's metrics reach the
step's (`rollout/env_judge/*`)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.runs import make_config

pytestmark = pytest.mark.ray


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_judge_rewarded_environment_trains(ray_local, engine, tmp_path, mode):
    from palaestra.train import train

    record = tmp_path / "verdicts.jsonl"
    judge = f"{{url: '{engine.url}', tokenizer: tiny, max_tokens: 8, timeout_s: 120, record: '{record}'}}"
    cfg = make_config(
        tmp_path / mode,
        mode,
        "engines.count=1",
        "env.name=judged-math",
        f"env.args={{difficulty: 1, max_tokens: 12, judge: {judge}}}",
        "env.eval_tasks=0",
        "run.steps=1",
        "run.checkpoint_every=0",
    )
    result = train(cfg)
    (trained,) = result.trained
    assert len(trained.sample_ids) == 4  # the policy's samples only: the judge's calls are not among them
    verdicts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(verdicts) >= 4 and all(v["session_id"] for v in verdicts)
    assert all((v["score"] is None) == (v["failure"] is not None) for v in verdicts)
    step = next(r for r in result.state.rows if "rollout/reward_mean" in r)
    assert math.isfinite(step["rollout/env_judge/failed"]) and math.isfinite(step["rollout/env_judge/time_s"])
    assert step["rollout/env_judge/time_s"] > 0
