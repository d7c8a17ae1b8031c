"""A sandbox that dies under an episode fails that episode (``sandbox_error``), never a reward of 0
the policy would learn from: the harbor environment on the local (bubblewrap) backend, the
sandbox's own process (bwrap, which holds the exec server `agent.py`) SIGKILLed by its process
group while the oracle's command runs in it (the swe and harness environments: in
test_swe_workspace.py, beside their shared instances); then through the gateway, the session
closes as failed with the reason and the runner and a training step count it.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter

import pytest

from palaestra.environments.episode import sandbox_failed
from palaestra.environments.harbor.env import HarborEnv
from palaestra.sandbox.base import SandboxError
from palaestra.sdk.environment import Environment, Reward, Task
from palaestra.sdk.session import EpisodeFailed
from tests.support.sandbox import KillingBackend


def test_harbor_episode_whose_sandbox_dies_fails_with_the_reason(local_sandbox, tmp_path, monkeypatch):
    """The oracle's solve.sh is running when the trial's sandbox dies (no model: no session)."""
    from palaestra.environments.harbor.env import EXAMPLES

    monkeypatch.setenv("PALAESTRA_HARBOR_CACHE", str(tmp_path / "cache"))
    task_dir = tmp_path / "tasks" / "slow-oracle"
    shutil.copytree(EXAMPLES / "csv-summary", task_dir)
    (task_dir / "solution" / "solve.sh").write_text("sleep 30\n")
    backend = KillingBackend(local_sandbox, marker="/solution/solve.sh")
    env = HarborEnv(path=str(task_dir), agent="oracle", backend=backend)
    with pytest.raises(EpisodeFailed, match="sandbox_error"):
        asyncio.run(env.rollout(None, next(env.tasks(0))))
    assert len(backend.killed) == 1


# ------------------------------------------------------------------ through the gateway and a step


class _DiesAfterOneTurn(Environment):
    """One model call, then the sandbox fails under it."""

    name = "dies"

    def tasks(self, seed):
        return [Task(task_id="t0")]

    async def rollout(self, session, task) -> Reward:
        await session.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **session.sampling
        )
        raise sandbox_failed(SandboxError("sandbox sb-1: agent gone (connection reset)"))


def test_the_session_closes_failed_with_the_reason_and_a_step_counts_it(tok, tmp_path):
    import httpx

    from palaestra.orchestrator.batching import Batch, GroupRecord
    from palaestra.orchestrator.metrics import rollout_metrics
    from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
    from tests.support.sessions import rollouts

    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        lambda ids, index: tok.encode("ok", add_special_tokens=False) + [end], stop_ids={end}
    )
    with ThreadServer(engine.app()) as eng, gateway_server(eng.url, tmp_path, tok, api_key="k-flk") as gw:
        (result,) = rollouts(gw.url, "k-flk", _DiesAfterOneTurn(), [Task(task_id="t0")]).results
        headers = {"Authorization": "Bearer k-flk"}
        session = httpx.get(f"{gw.url}/sessions/{result.session_id}", headers=headers).json()
        samples = httpx.get(f"{gw.url}/samples", params={"limit": 100}, headers=headers).json()["samples"]
    assert result.status == "failed" and result.failure == "sandbox_error", result
    assert "agent gone" in result.error
    assert session["status"] == "failed" and session["metrics"]["failure/sandbox_error"] == 1.0, session
    assert samples and {s["status"] for s in samples} == {"failed"}  # spooled, never trainable

    record = GroupRecord(0, "t0", "g", [], [], {"failed": 1}, {}, 0, 0.0, 1.0, failures={"sandbox_error": 1})
    metrics = rollout_metrics(Batch([], [], [], Counter(), [record]))
    assert metrics["rollout/failed_sandbox_error"] == 1.0 and metrics["rollout/sessions_failed"] == 1.0


def test_an_episode_failure_needs_a_name():
    with pytest.raises(ValueError, match="reason must be a short name"):
        EpisodeFailed("the sandbox died")
