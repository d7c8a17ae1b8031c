"""`palaestra train` on the harbor environment: one sync step of the `tiny` preset (the embedded
engine) on an example Harbor task, attempted by each of three agents in the local (bubblewrap)
sandbox, graded by the task's test.sh: the openai-tools loop (the OpenAI SDK's chat completions
with a bash tool), and two CLI harnesses, unchanged, through their session tunnels: mini-swe-agent
(bash-only, ~1,500-token prompts) and OpenCode (told an output budget of 16 tokens per call; per
episode a 1,128-token title request and a 14,714-token first prompt in the `tiny` tokenizer, its
system prompt and tools: the engine's prefill and the trainer's passes over two such samples make
its case 3-4x the mini-swe-agent case's time).

The random model does not solve the task (reward 0); what is checked is the path: the task's
environment built, both episodes graded by the verifier (its named reward reaches the step's
metrics), a harness's calls recorded through its tunnel, and the samples trained (on the exact ids
the gateway recorded). Each case is its own train run on the module's Ray. The harness episodes
that fix a task are tests/environments/test_harbor_e2e.py's, with a scripted engine.
"""

from __future__ import annotations

import json
import math

import pytest

from palaestra.environments.harness.install import HARNESSES, binary
from tests.support.runs import make_episode_config
from tests.support.sandbox import SANDBOX_BACKENDS

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.engine]


AGENTS = {
    "openai-tools": {"max_turns": 2, "max_tokens": 16},
    "mini-swe-agent": {"max_turns": 2},
    "opencode": {"max_turns": 2, "max_output_tokens": 16},
}
"""Each agent's arguments: two model calls per episode, 16 tokens each (the tool loop's
`max_tokens`, the output budget OpenCode is told; mini-swe-agent asks for none: the gateway's
`default_max_tokens`)."""


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_train_one_step_on_a_harbor_task(ray_local, tmp_path, agent):
    from palaestra.train import train

    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    if agent in HARNESSES and binary(agent) is None:
        h = HARNESSES[agent]
        pytest.skip(
            f"{h.package}@{h.version} is not installed: run `make install` (palaestra harness install {agent})"
        )
    args = {"agent": agent, "backend": "local", "tasks": ["set-port"], **AGENTS[agent]}
    out = tmp_path / "run"
    result = train(
        make_episode_config(
            out,
            "harbor",
            args,
            "gateway.default_max_tokens=16",
            "run.checkpoint_every=0",
            "run.step_timeout_s=300",
        )
    )
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # both episodes trained: a sample id is <session>-<n>-...; a harness's session may hold more than
    # one sample (OpenCode's title request is a conversation of its own; mini-swe-agent's next prompt
    # re-renders the random reply, a fork)
    assert len(result.trained) == 1 and len({s.split("-")[0] for s in result.trained[0].sample_ids}) == 2, (
        result.trained
    )
    assert step["rollout/sessions_completed"] == 2 and math.isfinite(step["train/loss"]), step
    assert step["rollout/env_reward/reward"] == step["rollout/reward_mean"], step  # test.sh graded both
    assert step["rollout/env_failure/sandbox_error"] == 0 and "rollout/env_env/build_cache_hit" in step, step
    if agent in HARNESSES:  # its calls came through the tunnel, as the samples' turns
        assert step["rollout/env_harness/calls"] >= 1 and step["rollout/env_tunnel/refused"] == 0, step
