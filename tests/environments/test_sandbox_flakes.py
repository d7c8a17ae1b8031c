"""A sandbox that dies under an episode fails that episode (``sandbox_error``), never a reward of 0
the policy would learn from: the swe, harness and harbor environments on the local (bubblewrap)
backend, the sandbox's own process (bwrap, which holds the exec server `agent.py`) SIGKILLed by its
process group while a command of the episode runs in it; then through the gateway, the session
closes as failed with the reason and the runner and a training step count it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import types
from collections import Counter

import pytest

from palaestra.environments.episode import sandbox_failed
from palaestra.environments.harbor.env import HarborEnv
from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.harness.install import binary
from palaestra.environments.swe_agent.env import SweAgentEnv
from palaestra.sandbox.base import SandboxError
from palaestra.sdk.environment import Environment, Reward, Task
from palaestra.sdk.session import EpisodeFailed
from tests.support.sandbox import SANDBOX_BACKENDS

KILL = "palaestra-kill-me"
"""A command holding this text has its sandbox killed while it runs."""


class KillingBackend:
    """A real backend whose sandbox is SIGKILLed (its process group: bwrap and everything under
    it) while an exec whose command or stdin holds `marker` runs in it. Everything else is the
    backend's."""

    def __init__(self, backend, marker: str = KILL):
        self.backend, self.marker = backend, marker
        self.killed: list[int] = []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    async def create(self, *args, **kwargs):
        box = await self.backend.create(*args, **kwargs)
        real = box.exec

        async def exec(*a, **kw):
            if self.marker not in json.dumps([a, kw], default=str):
                return await real(*a, **kw)
            run = asyncio.ensure_future(real(*a, **kw))
            await asyncio.sleep(0.5)  # the command is running
            assert not run.done(), run.result()
            os.killpg(box.pid, signal.SIGKILL)
            self.killed.append(box.pid)
            return await run

        box.exec = exec
        return box


@pytest.fixture(scope="module")
def local():
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    with SANDBOX_BACKENDS["local"]() as make:
        yield make()


def _reply(name: str, arguments: dict) -> object:
    from openai.types.chat import ChatCompletion

    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "policy",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
        }
    )


def _session(replies: list) -> types.SimpleNamespace:
    """A SCRIPTED session (no gateway): its client answers each call with the next of `replies`."""

    async def create(**kwargs):
        return replies.pop(0)

    completions = types.SimpleNamespace(create=create)
    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=completions))
    return types.SimpleNamespace(
        client=client, sampling={}, session_id="s1", api_key="k", base_url="http://127.0.0.1:9/s/s1/v1"
    )


def test_swe_episode_whose_sandbox_dies_fails_with_the_reason(local, swe_data):
    backend = KillingBackend(local)
    env = SweAgentEnv(data=str(swe_data), backend=backend, max_turns=4)
    task = env.tasks(0)[0]
    replies = [_reply("bash", {"command": "ls"}), _reply("bash", {"command": f"sleep 30 # {KILL}"})]
    with pytest.raises(EpisodeFailed, match="sandbox_error") as failed:
        asyncio.run(env.rollout(_session(replies), task))
    assert failed.value.reason == "sandbox_error" and len(backend.killed) == 1
    assert not replies  # the first tool call ran in the sandbox; it died under the second


class _Harness(HarnessEnv):
    """The real harness environment, told the context window without a gateway (its one HTTP call
    before the harness runs)."""

    @staticmethod
    async def context_window(session) -> int:
        return 32768


def test_harness_episode_whose_sandbox_dies_fails_with_the_reason(local, swe_data):
    """The harness's one exec (forward.py and the harness) is running when its sandbox dies."""
    if binary("mini-swe-agent") is None:
        pytest.skip("mini-swe-agent is not installed: run `make install`")
    backend = KillingBackend(local)
    env = _Harness(harness="mini-swe-agent", data=str(swe_data), backend=backend, time_limit_s=60)
    task = env.tasks(0)[0]
    original = env.config

    def config(*args, **kwargs):  # the marker in what forward.py reads, so that its exec is the one killed
        return {**original(*args, **kwargs), "marker": KILL}

    env.config = config
    with pytest.raises(EpisodeFailed, match="sandbox_error"):
        asyncio.run(env.rollout(_session([]), task))
    assert len(backend.killed) == 1


def test_harbor_episode_whose_sandbox_dies_fails_with_the_reason(local, tmp_path, monkeypatch):
    """The oracle's solve.sh is running when the trial's sandbox dies (no model: no session)."""
    from palaestra.environments.harbor.env import EXAMPLES

    monkeypatch.setenv("PALAESTRA_HARBOR_CACHE", str(tmp_path / "cache"))
    task_dir = tmp_path / "tasks" / "slow-oracle"
    shutil.copytree(EXAMPLES / "csv-summary", task_dir)
    (task_dir / "solution" / "solve.sh").write_text("sleep 30\n")
    backend = KillingBackend(local, marker="/solution/solve.sh")
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
