"""The SDK and the math environment end to end: runner, CLI, failures, tool variant, external sessions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from palaestra.environments.math.env import MathEnv, MathToolEnv
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.sdk import Environment, GatewayClient, Task, run_rollouts
from palaestra.sdk.runner import take_tasks, wilson_interval
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import rollouts

pytestmark = pytest.mark.engine  # the shared engine (most tests)

KEY = {"Authorization": "Bearer k-sdk"}
ENV = {**os.environ, "PALAESTRA_API_KEY": "k-sdk"}


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    with gateway_server(engine.url, tmp_path_factory.mktemp("spool"), api_key="k-sdk") as gw:
        yield gw


def all_samples(gw):
    out, after = [], 0
    while True:
        page = httpx.get(f"{gw.url}/samples", params={"after": after, "limit": 1000}, headers=KEY).json()
        if not page["samples"]:
            return out
        out += page["samples"]
        after = page["cursor"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "palaestra.cli", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_rollout_cli_puts_grouped_rewarded_samples_in_the_spool(gateway):
    before = {s["sample_id"] for s in all_samples(gateway)}
    r = cli(
        "rollout",
        "--env",
        "math",
        "--gateway",
        gateway.url,
        "--tasks",
        "3",
        "--samples-per-task",
        "2",
        "--concurrency",
        "4",
        "--env-args",
        '{"max_tokens": 16}',
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert "6 rollouts" in r.stdout and "reward" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    new = [s for s in all_samples(gateway) if s["sample_id"] not in before]
    assert {s["sample_id"] for s in new} == set(summary["sample_ids"])
    groups: dict[str, list] = {}
    for s in new:
        groups.setdefault(s["group_id"], []).append(s)
        assert (
            s["env"] == "math"
            and isinstance(s["reward"], float)
            and s["status"] in ("completed", "truncated")
        )
        assert "correct" in s["metrics"] and sum(s["loss_mask"]) > 0
    assert len(groups) == 3 and all(len(v) == 2 for v in groups.values())
    assert all(len({s["task_id"] for s in v}) == 1 for v in groups.values())


def test_eval_cli_reports_accuracy_with_interval(gateway):
    r = cli(
        "eval",
        "--env",
        "math",
        "--gateway",
        gateway.url,
        "--tasks",
        "4",
        "--env-args",
        '{"max_tokens": 8}',
        "--quiet",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["n"] == 4 and 0.0 <= result["ci95"][0] <= result["accuracy"] <= result["ci95"][1] <= 1.0


def test_wilson_interval():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35
    lo, hi = wilson_interval(50, 100)
    assert 0.40 < lo < 0.41 and 0.59 < hi < 0.60


class Exploding(Environment):
    name = "exploding"

    def tasks(self, seed):
        return [Task("only")]

    async def rollout(self, session, task):
        await session.client.chat.completions.create(
            model="policy", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        raise RuntimeError("the environment broke")


def test_the_metrics_line_names_only_the_failures_that_happened():
    from palaestra.sdk.runner import RolloutResult, RolloutSummary

    def result(metrics):
        return RolloutResult("t", "g", "s", 1.0, "completed", metrics)

    clean = {"correct": 1.0, "failure/harness_exit": 0.0, "failure/sandbox_timeout": 0.0}
    summary = RolloutSummary([result(clean), result(clean)], wall_s=1.0)
    assert summary.metrics_line() == "metrics (mean over 2 rollouts): correct 1.000; failures: none"
    assert set(summary.metrics) == set(clean)  # --json keeps every counter
    summary = RolloutSummary([result(clean), result({**clean, "failure/sandbox_timeout": 1.0})], wall_s=1.0)
    assert summary.metrics_line().endswith("correct 1.000; failures: sandbox_timeout 0.500")
    # an environment without failure counters gets no failures clause
    assert RolloutSummary([result({"correct": 0.0})], 1.0).metrics_line() == (
        "metrics (mean over 1 rollouts): correct 0.000"
    )


def test_a_rollout_that_raises_closes_its_session_as_failed(gateway):
    async def run():
        gw = GatewayClient(gateway.url, "k-sdk")
        try:
            return await run_rollouts(Exploding(), gw, [Task("only")], samples_per_task=2, progress=False)
        finally:
            await gw.close()

    summary = asyncio.run(run())
    assert summary.statuses == {"failed": 2}
    assert all("the environment broke" in r.error for r in summary.results)
    for r in summary.results:
        traj = httpx.get(f"{gateway.url}/sessions/{r.session_id}", headers=KEY).json()
        assert traj["finished"] and traj["status"] == "failed"
    failed = [s for s in all_samples(gateway) if s["env"] == "exploding"]
    assert len(failed) == 2 and all(
        s["status"] == "failed" for s in failed
    )  # marked, never silently trained on


def test_sessions_share_one_connection_pool_that_outlives_each_session(gateway):
    """Every session's openai client uses the GatewayClient's pool (building a client per session
    costs ~18 ms of CPU); a finished session leaves it open for the next; close() closes it."""

    async def run():
        gw = GatewayClient(gateway.url, "k-sdk")
        replies = []
        for i in range(2):
            async with await gw.session("pool-test", task_id=f"t{i}") as session:
                reply = await session.client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                replies.append((session.client._client, reply.choices[0].message.content))
                await session.reward(1.0)
        pool = replies[0][0]
        assert pool is replies[1][0] and not pool.is_closed  # shared, still open
        await gw.close()
        assert pool.is_closed
        return replies

    assert len(asyncio.run(run())) == 2


def test_external_agent_session_commands(gateway):
    r = cli("session", "new", "--env", "external", "--gateway", gateway.url)
    assert r.returncode == 0, r.stderr
    info = dict(line.split(":", 1) for line in r.stdout.strip().splitlines())
    base_url, sid, token = info["base_url"].strip(), info["session_id"].strip(), info["api_key"].strip()
    assert token != "k-sdk"  # the session's own token, never the environment key
    answer = httpx.post(
        f"{base_url}/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "policy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
    )
    assert answer.status_code == 200
    r = cli("session", "reward", sid, "0.75", "--gateway", gateway.url, "--metrics", '{"quality": 3}')
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] in ("completed", "truncated")
    mine = [s for s in all_samples(gateway) if s["session_id"] == sid]
    assert len(mine) == 1 and mine[0]["reward"] == 0.75 and mine[0]["metrics"]["quality"] == 3.0


def test_tool_variant_multi_turn_with_tool_tokens_masked(tok, tmp_path):
    """A scripted engine (labelled test double) makes the random model call the calculator, then answer."""
    env = MathToolEnv(difficulty=1)
    task = take_tasks(env, 1, seed=7)[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = [
        render_tool_call_text("hermes", "calculator", json.dumps({"expression": "2 + 2"})),
        f"The answer is \\boxed{{{task.answer}}}.",
    ]
    engine = ScriptedEngine(
        lambda ids, i: tok.encode(replies[i], add_special_tokens=False) + [end], stop_ids={end}
    )
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path, tok, api_key="k-sdk") as gw,
    ):
        summary = rollouts(gw.url, "k-sdk", env, [task], samples_per_task=1)
        result = summary.results[0]
        assert result.status == "completed" and result.reward == 1.0 and result.metrics["tool_calls"] == 1.0
        sample = httpx.get(f"{gw.url}/samples", headers=KEY).json()["samples"][0]
    response = sample["tokens"][sample["prompt_len"] :]
    masked = tok.decode([t for t, m in zip(response, sample["loss_mask"], strict=True) if m == 0])
    sampled = tok.decode([t for t, m in zip(response, sample["loss_mask"], strict=True) if m == 1])
    assert "<tool_response>\n4\n</tool_response>" in masked  # the calculator's answer is environment text
    assert "<tool_response>" not in sampled and "\\boxed{" in sampled and "<tool_call>" in sampled
    assert sum(sample["loss_mask"]) == sum(len(ex.answer["output_ids"]) for ex in engine.exchanges)


def test_math_env_reads_gsm8k_files(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "Add them.\n#### 4"}) + "\n")
    tasks = take_tasks(MathEnv(data=str(path)), 5, seed=0)
    assert [(t.question, t.answer) for t in tasks] == [("2+2?", "4")]


def test_seeded_runs_sample_the_same_episodes(gateway):
    """`run_rollouts(sampling=..., seed=...)` gives every session `sampling` plus episode j's seed
    `episode_seed(seed, j)`; the math environment passes `session.sampling` on, so the same seed
    samples the same tokens at temperature 1 and another seed does not, and at temperature 0 the
    seed no longer matters (concurrency 1: the engine batches nothing differently)."""
    from palaestra.environments.math.env import MathEnv
    from palaestra.sdk.runner import episode_seed

    tasks = take_tasks(MathEnv(difficulty=0, kinds=["arithmetic"]), 4, seed=0)

    async def run(seed, temperature=1.0):
        gw = GatewayClient(gateway.url, "k-sdk")
        try:
            env = MathEnv(difficulty=0, kinds=["arithmetic"], max_tokens=12)
            summary = await run_rollouts(
                env,
                gw,
                tasks,
                samples_per_task=2,
                concurrency=1,
                progress=False,
                sampling={"temperature": temperature},
                seed=seed,
            )
        finally:
            await gw.close()
        by_id = {s["sample_id"]: s for s in all_samples(gateway)}
        return [by_id[r.sample_ids[0]]["tokens"] for r in summary.results]

    first, again, other = asyncio.run(run(7)), asyncio.run(run(7)), asyncio.run(run(8))
    assert first == again
    assert first != other
    assert asyncio.run(run(7, temperature=0.0)) == asyncio.run(run(8, temperature=0.0))  # greedy
    assert len({episode_seed(7, j) for j in range(8)}) == 8 and episode_seed(7, 0) == episode_seed("7", 0)


# ----------------------------------------------------------------------------------------------
# A new environment writer's path: the docs' example as a plug-in, the task contract, summaries
# ----------------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def docs_example() -> str:
    """The first Python listing under docs/environments.md's "## A whole environment"."""
    section = DOCS.read_text().split("## A whole environment", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def cli_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`palaestra ...` started in `cwd`, with nothing of it on PYTHONPATH (as a user runs it)."""
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "palaestra.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_the_docs_example_runs_as_a_plug_in_from_the_working_directory(gateway, tmp_path):
    """`--env unscramble:Unscramble` from the directory holding unscramble.py (the docs' listing,
    verbatim): rollout and eval load it as train does, and both summaries give the mean reward and
    the environment's own metrics."""
    (tmp_path / "unscramble.py").write_text(docs_example())
    common = ["--env", "unscramble:Unscramble", "--gateway", gateway.url, "--quiet", "--json"]
    r = cli_in(
        tmp_path,
        "rollout",
        *common,
        "--tasks",
        "2",
        "--samples-per-task",
        "2",
        "--env-args",
        '{"max_tokens": 6}',
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "4 rollouts" in lines[0] and "reward" in lines[0]
    assert (
        lines[1].startswith("metrics (mean over 4 rollouts): answer_chars ") and "correct 0.000" in lines[1]
    )
    summary = json.loads(lines[-1])
    assert set(summary["metrics"]) == {"answer_chars", "correct"} and summary["reward_mean"] == 0.0
    samples = [s for s in all_samples(gateway) if s["sample_id"] in set(summary["sample_ids"])]
    assert len(samples) == 4 and {s["env"] for s in samples} == {"unscramble"}

    r = cli_in(tmp_path, "eval", *common, "--tasks", "3", "--env-args", '{"max_tokens": 6}')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("accuracy 0.000 ± 0.000 s.e. (95% CI 0.000-") and "; reward 0.000;" in lines[0]
    assert lines[1].startswith("  unscramble: accuracy 0.000 ")  # its tasks have no kind: one, by its name
    assert lines[2].startswith("metrics (mean over 3 rollouts): ")
    result = json.loads(lines[-1])
    assert result["n"] == 3 and set(result["metrics"]) == {"answer_chars", "correct"}


def test_a_plug_in_that_is_not_there_says_where_it_looked(tmp_path):
    for command in ("rollout", "eval"):
        r = cli_in(tmp_path, command, "--env", "wordgames.scramble:Env", "--gateway", "http://127.0.0.1:9")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert (
            f"palaestra {command}: --env: environment 'wordgames.scramble:Env': no module named 'wordgames'"
            in r.stderr
        )
        assert str(tmp_path) in r.stderr and "PYTHONPATH" in r.stderr
    (tmp_path / "wordgames").mkdir()
    (tmp_path / "wordgames" / "__init__.py").write_text("")
    (tmp_path / "wordgames" / "scramble.py").write_text(docs_example())
    r = cli_in(tmp_path, "rollout", "--env", "wordgames.scramble:Env", "--gateway", "http://127.0.0.1:9")
    assert "'wordgames.scramble' has no attribute 'Env' (it has: " in r.stderr and "Unscramble" in r.stderr
    r = cli_in(
        tmp_path,
        "rollout",
        "--env",
        "wordgames.scramble:Unscramble",
        "--env-args",
        '{"max_tokenz": 4}',
        "--gateway",
        "http://127.0.0.1:9",
    )
    assert "--env-args: 'max_tokenz' is not an argument of environment" in r.stderr, r.stderr
    assert "which takes max_tokens)" in r.stderr and "Traceback" not in r.stderr


class DictTasks(Environment):
    """Yields dicts: the mistake the task contract's error is for."""

    name = "dict-tasks"

    def tasks(self, seed):
        return [{"id": 1, "word": "planet"}]

    async def rollout(self, session, task):
        raise AssertionError("never reached: the contract is checked before any session")


class NoIdTasks(DictTasks):
    name = "no-id"

    def tasks(self, seed):
        return [Task(task_id="")]


def test_the_task_contract_is_checked_before_any_session():
    from palaestra.sdk.environment import TaskError, check_task

    async def run(env):
        gw = GatewayClient("http://127.0.0.1:9", "k", retries=0)  # nothing listens: a session would fail
        try:
            return await run_rollouts(env, gw, env.tasks(0), progress=False)
        finally:
            await gw.close()

    with pytest.raises(TaskError) as info:
        asyncio.run(run(DictTasks()))
    message = str(info.value)
    assert message.startswith(
        "environment 'dict-tasks' (tests.sdk.test_math_rollouts.DictTasks).tasks() yielded a dict"
    )
    assert "without a 'task_id' attribute (a dict with keys ['id', 'word']: wrap it as Task(" in message
    assert "docs/environments.md" in message
    with pytest.raises(TaskError, match="whose task_id is '' .str.; a task_id must be a non-empty str"):
        asyncio.run(run(NoIdTasks()))
    assert (
        check_task(DictTasks(), Task(task_id="a")) == "a" and check_task(DictTasks(), Task(task_id=7)) == "7"
    )


def test_the_training_runner_checks_the_first_task_as_it_starts():
    """`palaestra train`'s environment runner (the RolloutWorker actor, built here without Ray)
    fails its start on a task without an id, so the run stops at "starting the environment"; its
    TaskSource checks every task it reads."""
    from palaestra.orchestrator.rollout_worker import RolloutWorker, TaskSource
    from palaestra.sdk.environment import TaskError

    args = ({}, {"temperature": 1.0}, "http://127.0.0.1:9", "k", 0, 2, 4, "run")
    with pytest.raises(TaskError, match="environment 'dict-tasks' .*yielded a dict without a 'task_id'"):
        RolloutWorker("tests.sdk.test_math_rollouts:DictTasks", *args)
    worker = RolloutWorker("math", {"difficulty": 0, "kinds": ["arithmetic"]}, *args[1:])
    assert worker.tasks.get(0).task_id == "arithmetic-d0-s0-0"

    class SecondIsBad(DictTasks):
        def tasks(self, seed):
            return [Task(task_id="ok"), {"id": 2}]

    source = TaskSource(SecondIsBad(), seed=0)
    assert source.get(0).task_id == "ok"
    with pytest.raises(TaskError, match="yielded a dict"):
        source.get(1)
