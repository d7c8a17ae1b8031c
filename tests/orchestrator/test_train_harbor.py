"""`palaestra train` on the harbor environment: one sync step of the `tiny` preset (the embedded
engine) on an example Harbor task, attempted by the openai-tools agent (the OpenAI SDK's chat
completions with a bash tool) in the local (bubblewrap) sandbox, graded by the task's test.sh.

The random model does not solve the task (reward 0); what is checked is the path: the task's
environment built, both episodes graded by the verifier (its named reward reaches the step's
metrics), and their samples trained. The harness agents' episodes through the gateway are
tests/environments/test_harbor_e2e.py's (Claude Code through `palaestra eval`, Codex), with a
scripted engine; a harness's 18,000-token prompts make a train step minutes long on CPU
(tests/orchestrator/test_train_harness.py trains one with Codex).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.support.runs import make_config
from tests.support.sandbox import SANDBOX_BACKENDS

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.engine]


def test_train_one_step_on_a_harbor_task(ray_local, tmp_path):
    from palaestra.train import train

    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    args = {
        "agent": "openai-tools",
        "backend": "local",
        "tasks": ["set-port"],
        "max_turns": 2,
        "max_tokens": 16,
    }
    out = tmp_path / "run"
    result = train(
        make_config(
            out,
            "sync",
            "engines.count=1",
            "env.name=harbor",
            f"env.args={json.dumps(args)}",
            "env.tasks_per_step=1",
            "env.samples_per_task=2",
            "env.concurrency=2",
            "env.eval_tasks=0",
            "env.filter_zero_variance_groups=false",
            "run.steps=1",
            "run.checkpoint_every=0",
            "run.step_timeout_s=300",
        )
    )
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert [len(r.sample_ids) for r in result.trained] == [2], result.trained
    assert step["rollout/sessions_completed"] == 2 and math.isfinite(step["train/loss"]), step
    assert step["rollout/env_reward/reward"] == step["rollout/reward_mean"], step  # test.sh graded both
    assert step["rollout/env_failure/sandbox_error"] == 0 and "rollout/env_env/build_cache_hit" in step, step
