"""`palaestra train` on the harness environment: the real Codex CLI, unchanged, in the local
(bubblewrap) sandbox on a generated SWE instance, through its session's tunnel, against the `tiny`
preset on the embedded engine; one sync step of one group of two episodes.

The random model answers Codex's first call with noise (`gateway.default_max_tokens` keeps it to
16 tokens: Codex sends no max_output_tokens), on which Codex stops ("Incomplete response returned,
reason: max_output_tokens", exit 1: `failure/harness_exit`), so each episode is one turn and
reward 0; what is checked is the path: turns recorded, the episode graded by swe's hidden tests,
the samples trained. Expensive: 135-175 s in a fresh-clone CI run, the suite's longest test. Its
parts: generating the swe instance (the session's `swe_instance`: the bundled textkit repository's
tests run in sandboxes for one mutation kind: 1.1 s against `swe_data`'s five kinds' 6.7 s at load
average ~3, 8-12 s against 64-76 s at ~43), the run's start (one engine, router, gateway,
trainer), two Codex episodes each prefilling a ~18,200-token prompt (Codex's instructions and
tools in the `tiny` tokenizer) and graded by swe's hidden tests, and the trainer's step on the two
samples (the packed attention no longer builds a dense [n, n] mask: trainer/packed_attention.py).
Codex rather than Claude Code: Claude Code asks for `max_tokens: 32000`, which a random model fills
to the context (minutes per turn on CPU); Claude Code's episode in the sandbox is
tests/environments/test_harness_env.py's.
"""

from __future__ import annotations

import json
import math

import pytest

from palaestra.environments.harness.install import HARNESSES, binary
from tests.support.runs import make_episode_config
from tests.support.sandbox import SANDBOX_BACKENDS

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.engine]


def test_train_one_step_on_codex_episodes_in_the_sandbox(ray_local, swe_instance, tmp_path):
    from palaestra.train import train

    if binary("codex") is None:
        h = HARNESSES["codex"]
        pytest.skip(
            f"{h.package}@{h.version} is not installed: run `make install` (palaestra harness install codex)"
        )
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    args = {
        "harness": "codex",
        "data": str(swe_instance),
        "backend": "local",
        "max_turns": 4,
        "time_limit_s": 300,
    }
    out = tmp_path / "run"
    result = train(
        make_episode_config(out, "harness", args, "gateway.default_max_tokens=16", "run.step_timeout_s=900")
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = rows[0]
    assert [len(r.sample_ids) for r in result.trained] == [2], result.trained  # both episodes trained
    assert step["rollout/sessions_completed"] == 2 and math.isfinite(step["train/loss"]), step
    # each episode: Codex's calls reached the gateway through the tunnel and were recorded as the
    # samples' turns (its 18,000-token first prompt), and the episode was graded (reward 0 here)
    assert step["rollout/env_harness/calls"] >= 1 and step["rollout/env_tunnel/refused"] == 0, step
    assert step["rollout/sampled_tokens"] > 0 and step["rollout/env_patch_applies"] == 1.0, step
    assert (
        step["rollout/env_failure/harness_timeout"] == 0 and step["rollout/env_failure/sandbox_error"] == 0
    ), step
