"""The harbor environment through the gateway, end to end, in the local (bubblewrap) sandbox:
`palaestra eval --env harbor` with Claude Code and with mini-swe-agent (the real harnesses,
unchanged), in-process episodes with Codex and with our Terminus-style agent, and one with the plain
openai-tools loop; each fixes the example task fix-greeting and test.sh scores it 1.

The engine is `ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py): the random
`tiny` model's place is taken by an agent that acts on cue (it answers the shell tool with a call
that writes the fix, then a final text). The gateway, the Qwen2.5 template, the tokenizer, the
sandbox, the tunnel, the harnesses, the task's build and its verifier are real. `palaestra train`
on harbor tasks with the tiny model is tests/orchestrator/test_train_harbor.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from palaestra.environments.harbor.env import HarborEnv
from palaestra.gateway.parsers import render_tool_call_text
from tests.environments.test_harness_env import MARK, ShellScript, _installed, stack
from tests.support.sandbox import SANDBOX_BACKENDS
from tests.support.servers import ENV_KEY
from tests.support.sessions import AUTH, rollouts

pytestmark = pytest.mark.slow

FIX = (
    "printf 'def greet(name):\\n    return f\"Hello, {name}!\"\\n' > /app/greet.py && "
    "cat /app/greet.py && echo PALAESTRA-$((6*7))"
)
"""The fix of fix-greeting, then MARK (computed, so that the prompt holding the command does not)."""


@pytest.fixture
def harbor_cache(tmp_path, monkeypatch):
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    monkeypatch.setenv("PALAESTRA_HARBOR_CACHE", str(tmp_path / "harbor-cache"))


@pytest.mark.parametrize("harness", ["claude-code", "mini-swe-agent"])
def test_palaestra_eval_runs_a_harness_on_a_harbor_task(tok, tmp_path, harbor_cache, harness):
    _installed(harness)
    script = ShellScript(tok, harness, FIX)
    args = {"agent": harness, "backend": "local", "tasks": ["fix-greeting"], "max_turns": 6}
    with stack(tok, tmp_path, script) as (gw, engine):
        r = subprocess.run(
            [sys.executable, "-m", "palaestra.cli", "eval", "--env", "harbor", "--gateway", gw.url]
            + ["--tasks", "1", "--env-args", json.dumps(args), "--json"],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PALAESTRA_API_KEY": ENV_KEY},
        )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tool" in script.calls and "final" in script.calls, script.calls
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["accuracy"] == 1.0, summary
    metrics = summary["metrics"]
    assert metrics["failure/harness_exit"] == 0 and metrics["tunnel/refused"] == 0, metrics
    assert metrics["reward/reward"] == 1.0 and metrics["harness/calls"] == len(script.calls), metrics


@pytest.mark.parametrize("harness", ["codex", "terminus"])
def test_codex_and_terminus_fix_a_harbor_task(tok, tmp_path, harbor_cache, harness):
    _installed(harness)
    env = HarborEnv(agent=harness, backend="local", tasks=["fix-greeting"], max_turns=6)
    script = ShellScript(tok, harness, FIX)
    with stack(tok, tmp_path, script) as (gw, engine):
        result = rollouts(gw.url, ENV_KEY, env, [next(env.tasks(0))]).results[0]
    assert result.status == "completed", result.error
    assert "tool" in script.calls and result.reward == 1.0, (script.calls, result.metrics)
    assert result.metrics["failure/harness_timeout"] == 0 and result.metrics["env/build_cache_hit"] == 0.0


class BashScript:
    """TEST DOUBLE for the openai-tools loop: first a bash call writing the fix, then a final text."""

    def __init__(self, tok):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.calls = 0

    def __call__(self, input_ids, index):
        self.calls += 1
        prompt = self.tok.decode(input_ids)
        if MARK in prompt:
            text = "Fixed."
        else:
            text = render_tool_call_text("hermes", "bash", json.dumps({"command": FIX}))
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


def test_the_openai_tools_loop_fixes_a_harbor_task(tok, tmp_path, harbor_cache):
    env = HarborEnv(agent="openai-tools", backend="local", tasks=["fix-greeting"], max_turns=4)
    script = BashScript(tok)
    with stack(tok, tmp_path, script) as (gw, engine):
        result = rollouts(gw.url, ENV_KEY, env, [next(env.tasks(0))]).results[0]
        session = httpx.get(f"{gw.url}/sessions/{result.session_id}", headers=AUTH).json()
    assert result.status == "completed" and result.reward == 1.0, (result.error, result.metrics)
    assert script.calls == 2 and result.metrics["tool_calls"] == 1.0, result.metrics
    assert len(session["turns"]) == 2, session  # the tool round trip recorded as the session's turns
