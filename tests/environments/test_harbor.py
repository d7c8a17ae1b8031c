"""The harbor environment's parts: task.toml read and refused, a Dockerfile's offline build plan,
Harbor's reward contract; then, in the local (bubblewrap) sandbox, tasks built once and cached,
the SCRIPTED agents ``oracle`` (solution/solve.sh) and ``none`` graded by test.sh, and a verifier
that cannot grade failing the episode instead of scoring it 0. Model-driven episodes (a harness,
openai-tools) are test_harbor_e2e.py's."""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
from pathlib import Path

import pytest

from palaestra.environments.harbor.agents import BUILTIN_AGENTS, HarnessAgent, make_agent
from palaestra.environments.harbor.build import build_environment
from palaestra.environments.harbor.dockerfile import DockerfileError, layer_root, read_dockerfile
from palaestra.environments.harbor.env import EXAMPLES, HarborEnv
from palaestra.environments.harbor.task import TaskError, load_task, load_tasks
from palaestra.environments.harbor.trial import GraderFailure, read_rewards
from palaestra.environments.harbor.validate import attempt_reward, validate_task
from palaestra.environments.harness.install import HARNESSES
from tests.support.sandbox import SANDBOX_BACKENDS


def dockerfile(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> Path:
    context = tmp_path / "environment"
    context.mkdir(parents=True, exist_ok=True)
    for name, body in (files or {}).items():
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        (context / name).write_text(body)
    path = context / "Dockerfile"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def make_task(tmp_path: Path, name: str = "t", *, toml: str = "", test: str = "", docker: str = "") -> Path:
    root = tmp_path / name
    (root / "tests").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "task.toml").write_text(textwrap.dedent(toml))
    (root / "instruction.md").write_text("Write 1 to /app/x.\n")
    dockerfile(root, docker or "FROM python:3.12\nWORKDIR /app\n")
    (root / "tests" / "test.sh").write_text(
        test or "cat /app/x > /logs/verifier/reward.txt 2>/dev/null || echo 0 > /logs/verifier/reward.txt\n"
    )
    (root / "solution" / "solve.sh").write_text("echo 1 > /app/x\n")
    return root


# ----------------------------------------------------------------------------------- task.toml


def test_the_examples_load_with_their_timeouts_and_resources():
    tasks = load_tasks(EXAMPLES)
    assert len(tasks) == 12 and all(t.has_solution for t in tasks)
    greet = next(t for t in tasks if t.task_id == "fix-greeting")
    assert (greet.agent_timeout_s, greet.verifier_timeout_s, greet.memory_mb, greet.cpus) == (
        300,
        60,
        1024,
        1,
    )
    assert not greet.wants_internet and "Hello, NAME!" in greet.instruction
    assert load_tasks(EXAMPLES / "fix-greeting")[0].task_id == "fix-greeting"  # one task by its path


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("[[steps]]\nname = 'a'\n", "steps"),
        ("[verifier]\nenvironment_mode = 'separate'\n", "environment_mode = separate"),
        ("[environment]\ngpus = 1\n", "gpus"),
        ("[environment]\nos = 'windows'\n", "os = 'windows'"),
        ("[environment]\nhealthcheck = {command = 'true'}\n", "healthcheck"),
        ("[agent]\nuser = 'agent'\n", r"\[agent\].user"),
        ("[environment]\nskills_dir = '/skills'\n", "skills_dir"),
        ("artifacts = ['/app/out']\n", "artifacts"),
        ("[agent]\ntimeout_sec = 'long'\n", r"\[agent\].timeout_sec: must be a positive number; got 'long'"),
        ("[verifier]\ntimeout_sec = -1\n", r"\[verifier\].timeout_sec: must be a positive number; got -1"),
        ("[environment]\nmemory_mb = 1e400\n", "memory_mb: must be a positive number"),
        ("[verifier\n", "task.toml does not parse"),
        (
            "[verifier.env]\nKEY = '${OPENAI_API_KEY}'\n",
            r"\[verifier\].env.KEY: \$\{OPENAI_API_KEY\} reads the host",
        ),
    ],
)
def test_what_we_cannot_honour_is_refused_naming_the_field(tmp_path, toml, match):
    with pytest.raises(TaskError, match=match):
        load_task(make_task(tmp_path, toml=toml))


def test_env_tables_take_literals_and_template_defaults(tmp_path):
    root = make_task(
        tmp_path, toml="[environment.env]\nA = 'x'\nB = '${MODE:-fast}/y'\n[verifier.env]\nC = 'z'\n"
    )
    task = load_task(root)
    assert (task.env, task.verifier_env) == ({"A": "x", "B": "fast/y"}, {"C": "z"})


def test_a_task_asking_for_the_network_runs_isolated_or_is_refused(tmp_path):
    root = make_task(tmp_path, toml="[environment]\nallow_internet = true\n")
    assert load_task(root).wants_internet  # isolated: our sandboxes have no network
    with pytest.raises(TaskError, match="asks for the network"):
        load_task(root, internet="refuse")
    quiet = make_task(tmp_path, "quiet", toml="[environment]\nnetwork_mode = 'no-network'\n")
    assert not load_task(quiet, internet="refuse").wants_internet


def test_missing_parts_are_named(tmp_path):
    root = make_task(tmp_path)
    (root / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="tests/test.sh is missing"):
        load_task(root)
    compose = make_task(tmp_path, "compose")
    (compose / "environment" / "Dockerfile").unlink()
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(TaskError, match=r"without a Dockerfile \(docker-compose.yaml\)"):
        load_task(compose)
    with pytest.raises(TaskError, match="holds no task.toml"):
        load_tasks(tmp_path / "compose" / "tests")


# ---------------------------------------------------------------------------------- Dockerfile


def test_a_dockerfile_becomes_an_offline_build_plan(tmp_path):
    path = dockerfile(
        tmp_path,
        """
        # comment
        ARG VERSION=3.12
        FROM docker.io/library/python:${VERSION}-slim AS base
        ENV DATA=/app/data \\
            MODE=test
        WORKDIR /app
        COPY src/ ./src/
        COPY ["a.txt", "/opt/tool/a.txt"]
        RUN echo $MODE > mode.txt
        USER nobody
        EXPOSE 80
        CMD ["python3"]
        """,
        {"src/m.py": "", "a.txt": "a"},
    )
    plan = read_dockerfile(path)
    assert plan.profile == "python" and plan.base == "docker.io/library/python:3.12-slim"
    assert plan.env == {"DATA": "/app/data", "MODE": "test"} and plan.workdir == "/app"
    assert plan.roots == ["/app", "/opt/tool"]
    assert [(s.kind, s.line) for s in plan.steps] == [("WORKDIR", 6), ("COPY", 7), ("COPY", 8), ("RUN", 9)]
    assert plan.steps[1].args == ("src/", "/app/src/")
    into = read_dockerfile(
        dockerfile(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nCOPY a.txt .\nCOPY a.txt /app\n")
    )
    assert [s.args for s in into.steps[1:]] == [("a.txt", "/app/"), ("a.txt", "/app/")]  # into the folder


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("FROM node:20\n", r"Dockerfile:1: FROM node:20: no offline image for 'node' \(python\*"),
        ("FROM python:3\nFROM python:3\n", "Dockerfile:2: .*multi-stage"),
        ("FROM python:3\nCOPY --from=build /x /app/x\n", "Dockerfile:2: COPY --from"),
        ("FROM python:3\nVOLUME /data\n", "Dockerfile:2: VOLUME /data: volumes"),
        (
            "FROM python:3\nCOPY a.txt /etc/a.txt\n",
            "Dockerfile:2: .*/etc/a.txt is under /etc, which the sandbox owns",
        ),
        (
            "FROM python:3\nADD https://example.invalid/x.tgz /app/\n",
            "Dockerfile:2: ADD https://example.invalid/x.tgz /app/: ADD of a URL",
        ),
        ("FROM python:3\nCOPY ../secret /app/\n", "not in the task's environment/ context"),
        ("FROM python:3\nWORKDIR /usr/src/app\n", "Dockerfile:2: .*under /usr"),
        ("FROM python:3\nCOPY a.txt /a.txt\n", "copies a file to /a.txt directly under /"),
        ("RUN true\n", "Dockerfile:1: RUN true: comes before FROM"),
        ("FROM python:3\nFROBNICATE\n", "unknown instruction FROBNICATE"),
    ],
)
def test_a_step_that_cannot_be_honoured_is_refused_naming_its_line(tmp_path, text, match):
    with pytest.raises(DockerfileError, match=match):
        read_dockerfile(dockerfile(tmp_path, text, {"a.txt": "a"}))


def test_layer_roots():
    assert layer_root("/app/src/x.py") == "/app" and layer_root("/opt/tool/bin") == "/opt/tool"
    assert layer_root("/opt") is None and layer_root("/logs/verifier") is None and layer_root("/") is None
    with pytest.raises(ValueError, match="under /tmp"):
        layer_root("/tmp/x")


# ------------------------------------------------------------------------------------- rewards


def test_the_reward_contract(tmp_path):
    (tmp_path / "reward.txt").write_text(" 0.25\n")
    assert read_rewards(tmp_path).value == 0.25 and read_rewards(tmp_path).named == {"reward": 0.25}
    (tmp_path / "reward.json").write_text(json.dumps({"reward": 1, "style": 0.5}))
    got = read_rewards(tmp_path)  # reward.json first, as Harbor reads them
    assert (got.value, got.named) == (1.0, {"reward": 1.0, "style": 0.5})
    (tmp_path / "reward.json").write_text(json.dumps({"accuracy": 0.75}))
    assert read_rewards(tmp_path).value == 0.75  # the only key
    (tmp_path / "reward.json").write_text(json.dumps({"a": 0.1, "b": 0.9}))
    with pytest.raises(GraderFailure, match=r"has \['a', 'b'\] and no 'reward': name the primary one"):
        read_rewards(tmp_path)
    assert read_rewards(tmp_path, reward_key="b").value == 0.9
    for bad, match in (
        ('{"reward": NaN}', "not a finite number"),
        ('{"reward": "1"}', "not a finite"),
        ("[1", "not JSON"),
        ("{}", "empty object"),
    ):
        (tmp_path / "reward.json").write_text(bad)
        with pytest.raises(GraderFailure, match=match):
            read_rewards(tmp_path)
    (tmp_path / "reward.json").unlink()
    (tmp_path / "reward.txt").write_text("yes")
    with pytest.raises(GraderFailure, match="holds 'yes', not a number"):
        read_rewards(tmp_path)
    (tmp_path / "reward.txt").unlink()
    with pytest.raises(GraderFailure, match="wrote neither"):
        read_rewards(tmp_path)


# -------------------------------------------------------------------------------------- agents


def test_every_installed_harness_name_is_an_agent_and_unknown_names_are_refused():
    for name in HARNESSES:  # a harness added to install.py's table is an agent here, untouched
        assert isinstance(make_agent(name), HarnessAgent) and make_agent(f"{name}@1.0").name == name
    assert {"openai-tools", "oracle", "none"} <= set(BUILTIN_AGENTS)
    with pytest.raises(ValueError, match="unknown agent 'aider': one of .*openai-tools"):
        make_agent("aider")
    assert HarborEnv(agent="opencode", max_output_tokens=16).agent.options.max_output_tokens == 16
    with pytest.raises(ValueError, match="max_output_tokens must be positive; got 0"):
        HarborEnv(agent="opencode", max_output_tokens=0)


def test_tasks_once_each_or_drawn_by_weight():
    env = HarborEnv(agent="none")
    assert sorted(t.task_id for t in env.tasks(0)) == sorted(p.name for p in EXAMPLES.iterdir())
    drawn = HarborEnv(agent="none", tasks={"fix-greeting": {"weight": 3}, "set-port": {}})
    ids = [next(it) for it in [drawn.tasks(1)] for _ in range(40)]
    assert {i.task.task_id for i in ids} == {"fix-greeting", "set-port"} and ids[0].task_id.endswith("/d0")
    with pytest.raises(TaskError, match="no harbor task 'nope'"):
        HarborEnv(agent="none", tasks=["nope"])
    with pytest.raises(ValueError, match="tasks.set-port.weight: must be a positive number"):
        HarborEnv(agent="none", tasks={"set-port": {"weight": 0}})


# ------------------------------------------------------------------ in the local sandbox (bwrap)


@pytest.fixture
def local(tmp_path, monkeypatch):
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    monkeypatch.setenv("PALAESTRA_HARBOR_CACHE", str(tmp_path / "cache"))
    with SANDBOX_BACKENDS["local"]() as make:
        yield make


def test_an_example_validates_and_its_environment_is_built_once(local, tmp_path):
    async def run():
        backend = local()
        task = load_task(EXAMPLES / "log-errors")  # RUN at build time writes the logs
        first = await build_environment(task, backend)
        again = await build_environment(task, backend)
        result = await validate_task(EXAMPLES / "log-errors", backend)
        return first, again, result

    first, again, result = asyncio.run(run())
    assert not first.cache_hit and again.cache_hit and first.root == again.root
    assert sorted(p.name for p in (first.layer(0) / "logs").iterdir()) == ["day0.log", "day1.log", "day2.log"]
    assert result.valid and (result.oracle, result.empty) == (1.0, 0.0), result


def test_a_verifier_that_cannot_grade_fails_the_episode(local, tmp_path):
    """No reward written, a crash, a timeout: GraderFailure (the runner counts the episode failed,
    never trained on), not a 0 the agent earned; validate says why."""
    silent = make_task(tmp_path, "silent", test="exit 3\n")
    slow = make_task(tmp_path, "slow", toml="[verifier]\ntimeout_sec = 1\n", test="sleep 30\n")
    broken = make_task(tmp_path, "broken", docker="FROM python:3.12\nWORKDIR /app\nRUN exit 7\n")

    async def run():
        backend = local()
        with pytest.raises(GraderFailure, match=r"wrote neither .* \(test.sh exit 3"):
            await attempt_reward(load_task(silent), backend, "oracle")
        with pytest.raises(GraderFailure, match=r"test.sh timeout .*timeout_sec = 1\)"):
            await attempt_reward(load_task(slow), backend, "none")
        return [await validate_task(p, backend) for p in (broken, silent)]

    broken_result, silent_result = asyncio.run(run())
    assert not broken_result.valid and "Dockerfile:3: RUN exit 7: failed at build" in broken_result.reason
    assert not silent_result.valid and "GraderFailure" in silent_result.reason


def test_the_verifier_sees_the_tasks_tests_not_what_the_agent_left_in_tests(local, tmp_path):
    """The agent plants /tests/test.sh (reward 1) and /tests/extra; the verifier's /tests holds the
    task's tests only, so the planted file scores nothing."""
    root = make_task(tmp_path, "plant")
    (root / "solution" / "solve.sh").write_text(
        "printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; touch /tests/extra; echo 0 > /app/x\n"
    )
    shutil.copy(root / "tests" / "test.sh", root / "tests" / "keep.sh")
    assert asyncio.run(attempt_reward(load_task(root), local(), "oracle")) == 0.0


def test_the_environment_scores_the_oracle_full_and_names_every_reward(local):
    """HarborEnv.rollout with the SCRIPTED oracle (no model: no session): the reward is test.sh's,
    every named reward of reward.json a metric, the build's cache hit recorded."""
    env = HarborEnv(agent="oracle", backend=local(), tasks=["csv-summary"])
    task = next(env.tasks(0))
    first, second = asyncio.run(_twice(env, task))
    assert first.value == 1.0 and first.metrics["reward/totals_correct"] == 1.0, first.metrics
    assert first.metrics["reward/file_written"] == 1.0 and first.metrics["oracle/exit_code"] == 0.0
    assert first.metrics["env/build_cache_hit"] == 0.0 and second.metrics["env/build_cache_hit"] == 1.0


async def _twice(env, task):
    return [await env.rollout(None, task) for _ in range(2)]


@pytest.mark.docker
def test_an_example_validates_in_docker_containers(tmp_path, monkeypatch):
    """The same build (a RUN step at build time) and verifier in the docker backend's containers."""
    monkeypatch.setenv("PALAESTRA_HARBOR_CACHE", str(tmp_path / "cache"))
    with SANDBOX_BACKENDS["docker"]() as make:  # skips, saying why, where no engine answers
        result = asyncio.run(validate_task(EXAMPLES / "log-errors", make()))
    assert result.valid and (result.oracle, result.empty) == (1.0, 0.0), result


def test_the_verifier_runs_with_the_tasks_env_and_workdir(local, tmp_path):
    """Dockerfile ENV and WORKDIR, [environment].env and [verifier].env all reach test.sh."""
    root = make_task(
        tmp_path,
        "envs",
        toml="[environment.env]\nA = '0.5'\n[verifier.env]\nB = 'x'\n",
        docker="FROM python:3.12\nENV C=y\nWORKDIR /srv/site\n",
        test='[ "$B$C$(pwd)" = xy/srv/site ] && echo $A > /logs/verifier/reward.txt\n',
    )
    assert asyncio.run(attempt_reward(load_task(root), local(), "none")) == 0.5


def test_palaestra_harbor_validate_prints_why_and_keeps_the_valid_tasks(local, tmp_path):
    import os
    import subprocess
    import sys

    tasks = tmp_path / "tasks"
    shutil.copytree(EXAMPLES / "fix-greeting", tasks / "fix-greeting")
    make_task(tasks, "solved-already", test="echo 1 > /logs/verifier/reward.txt\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "palaestra.cli",
            "harbor",
            "validate",
            str(tasks),
            "--out",
            str(tmp_path / "ok"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PALAESTRA_HARBOR_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == [
        "INVALID solved-already: the empty attempt already scores 1",
        "valid   fix-greeting: oracle 1, empty attempt 0",
    ], r.stdout
    assert "1/2 tasks valid" in r.stderr and [p.name for p in (tmp_path / "ok").iterdir()] == ["fix-greeting"]
