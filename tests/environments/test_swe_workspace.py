"""`SweWorkspace` (environments/swe_agent/workspace.py), the tasks, sandbox and grading that the swe
and harness environments both compose: on an instance of `palaestra swe generate --real`
(inflection's own pytest suite, its environment built offline from the cached sdists and wheels)
in the local (bubblewrap) sandbox, both environments grade the reference fix 1 and an unrelated
edit 0, made in the task's sandbox in place of an agent's work; the harness's own sandbox has the
environment and its shell runs the tests with it; an unfinished test run is one failure,
`sandbox_timeout`, for both; and a sandbox killed under either's episode (its process group, on
the local backend) fails the episode, `sandbox_error`, instead of scoring it.
"""

from __future__ import annotations

import asyncio

import pytest

from palaestra.environments.episode import EpisodeLog
from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.harness.install import HARNESSES, binary
from palaestra.environments.swe_agent import workspace
from palaestra.environments.swe_agent.env import SweAgentEnv
from palaestra.environments.swe_agent.grading import Grade
from palaestra.environments.swe_agent.repo_env import SANDBOX_ENV
from palaestra.environments.swe_agent.snapshot import apply_patch, patch_paths
from palaestra.sandbox.base import Limits
from palaestra.sdk.session import EpisodeFailed
from tests.support.doubles import SubprocessBackendForTests
from tests.support.sandbox import KILL, KillingBackend
from tests.support.sandbox_backends import backend_for
from tests.support.sessions import scripted_session, tool_reply

LIMITS = Limits(timeout_s=120.0, cpu_s=120, memory_mb=1024, pids=128)


@pytest.fixture(scope="module")
def envs(swe_real):
    """The swe and harness environments on the real-package instances, local backend."""
    data, options = swe_real
    with backend_for("local") as local:
        common = dict(
            data=str(data),
            backend=local,
            env_cache_dir=options.cache_dir,
            find_links=list(options.find_links),
            index=False,
        )
        yield {"swe": SweAgentEnv(**common), "harness": HarnessEnv(harness="claude-code", **common)}


async def _episode(env, task, edit: dict[str, bytes]) -> dict[str, float]:
    """`edit` (path -> content) written in the task's sandbox in place of an agent's work, then
    graded: the episode's metrics."""
    log = EpisodeLog()
    box = await env.workspace.start(task, LIMITS, log)
    async with box:
        for path, data in edit.items():
            await box.sandbox.upload(f"repo/{path}", data)
        tree = await box.take_out()
    reward = await env.workspace.grade(task, box.base, tree, log)
    assert reward.value == reward.metrics["resolved"]
    return reward.metrics


@pytest.mark.slow
def test_both_environments_grade_a_real_package_instance_alike(envs):
    task = envs["swe"].tasks(0)[0]
    assert task.test_cmd.startswith("python -m pytest") and "::" in task.FAIL_TO_PASS[0]
    fixed = apply_patch(task.base(), task.patch)
    fix = {path: fixed[path] for path in patch_paths(task.patch)}
    unrelated = {"NOTES.txt": b"nothing to do with the bug\n"}
    seen = {}
    for name, env in envs.items():
        seen[name, "fix"] = asyncio.run(_episode(env, task, fix))
        seen[name, "unrelated"] = asyncio.run(_episode(env, task, unrelated))
    for name in envs:
        right, wrong = seen[name, "fix"], seen[name, "unrelated"]
        assert right["resolved"] == 1.0 and right["f2p_passed"] == right["p2p_passed"] == 1.0, (name, right)
        assert wrong["resolved"] == 0.0 and wrong["f2p_passed"] < 1.0, (name, wrong)
        assert wrong["p2p_passed"] == 1.0 and wrong["patch_applies"] == 1.0, (name, wrong)
        for metrics in (right, wrong):  # graded in the instance's environment: no grader failure
            assert metrics["failure/grader_error"] == metrics["failure/sandbox_timeout"] == 0, (name, metrics)
    keys = ("resolved", "f2p_passed", "p2p_passed", "patch_applies", "patch_lines")
    for kind in ("fix", "unrelated"):
        assert {k: seen["swe", kind][k] for k in keys} == {k: seen["harness", kind][k] for k in keys}


@pytest.mark.slow
def test_the_harness_sandbox_runs_the_tests_in_the_instances_environment(envs, tmp_path):
    """The harness's own sandbox (its binary and run directory mounted) has the instance's
    environment, and the harness's environment variables put it first: the task's test command
    runs a PASS_TO_PASS test there, from the repository (its hidden test module written in, as an
    agent writes a test of its own: the agent's copy has no test of inflection's)."""
    h = HARNESSES["claude-code"]
    if binary("claude-code") is None:
        pytest.skip(f"{h.package}@{h.version} is not installed: run `make install`")
    env = envs["harness"]
    task = env.tasks(0)[0]

    async def run():
        box, harness_binary = await env.start(task, str(tmp_path), EpisodeLog())
        async with box:
            for path, data in apply_patch({}, task.test_patch).items():
                await box.sandbox.upload(f"repo/{path}", data)
            config = env.config(box, harness_binary, "s-test", "k-test")
            variables = [f"{k}={v}" for k, v in config["env"].items()]
            command = f"cd {config['cwd']} && python -c 'import sys; print(sys.prefix)' && "
            command += f"{task.test_cmd} {task.PASS_TO_PASS[0]}"
            return config, await box.sandbox.exec(["env", "-i", *variables, "sh", "-c", command])

    config, result = asyncio.run(run())
    assert config["env"]["PATH"].startswith(f"{SANDBOX_ENV}/bin:"), config["env"]
    assert task.test_cmd in config["argv"][2]  # the prompt names the instance's test command
    assert result.ok, (result.status, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout.splitlines()[0] == SANDBOX_ENV and "1 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize(
    "reason, failure",
    [("tests_did_not_finish: timeout", "sandbox_timeout"), ("test_command_failed: exit 2", "grader_error")],
)
def test_a_grade_that_could_not_decide_is_one_failure_for_both_environments(
    reason, failure, swe_data, monkeypatch
):
    """The grader's verdicts that are not the agent's doing are classified once, in the workspace:
    a test run that did not finish is `sandbox_timeout`, tests that could not start `grader_error`."""

    async def undecided(*args, **kwargs):
        return Grade(0.0, reason)

    monkeypatch.setattr(workspace.grading, "grade", undecided)
    backend = SubprocessBackendForTests()
    for env in (
        SweAgentEnv(data=str(swe_data), backend=backend),
        HarnessEnv(data=str(swe_data), backend=backend),
    ):
        task = env.tasks(0)[0]
        reward = asyncio.run(env.workspace.grade(task, task.base(), task.base(), EpisodeLog()))
        assert reward.value == 0.0 and reward.metrics[f"failure/{failure}"] == 1, reward.metrics
        others = [
            k
            for k, v in reward.metrics.items()
            if k.startswith("failure/") and v and k != f"failure/{failure}"
        ]
        assert others == [], reward.metrics


# ------------------------------------------------------------------ a sandbox that dies mid-episode
def test_a_swe_episode_whose_sandbox_dies_fails_with_the_reason(local_sandbox, swe_data):
    """The task's sandbox (its exec server) SIGKILLed while the agent's second command runs: the
    episode fails, `sandbox_error` (never trained), instead of a reward of 0."""
    backend = KillingBackend(local_sandbox)
    env = SweAgentEnv(data=str(swe_data), backend=backend, max_turns=4)
    replies = [tool_reply("bash", {"command": "ls"}), tool_reply("bash", {"command": f"sleep 30 # {KILL}"})]
    with pytest.raises(EpisodeFailed, match="sandbox_error") as failed:
        asyncio.run(env.rollout(scripted_session(replies), env.tasks(0)[0]))
    assert failed.value.reason == "sandbox_error" and len(backend.killed) == 1
    assert not replies  # the first command ran in the sandbox; it died under the second


class _ToldTheWindow(HarnessEnv):
    """The real harness environment, told the context window without a gateway (its one HTTP call
    before the harness runs)."""

    @staticmethod
    async def context_window(session) -> int:
        return 32768


def test_a_harness_episode_whose_sandbox_dies_fails_with_the_reason(local_sandbox, swe_data):
    """The harness's one exec (forward.py and the harness) is running when its sandbox dies."""
    if binary("mini-swe-agent") is None:
        pytest.skip("mini-swe-agent is not installed: run `make install`")
    backend = KillingBackend(local_sandbox)
    env = _ToldTheWindow(harness="mini-swe-agent", data=str(swe_data), backend=backend, time_limit_s=60)
    config = env.config
    # the marker in what forward.py reads on its stdin, so that this exec is the one killed
    env.config = lambda *args, **kwargs: {**config(*args, **kwargs), "marker": KILL}
    with pytest.raises(EpisodeFailed, match="sandbox_error"):
        asyncio.run(env.rollout(scripted_session([]), env.tasks(0)[0]))
    assert len(backend.killed) == 1
