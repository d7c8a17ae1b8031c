"""What a user reads from the CLI (issue 40): episodes shown as text (`--show`, `-v`, `session
show`), one line naming what to change when a command fails, evaluations stratified over the kinds
named with a standard error beside every accuracy, and `palaestra envs`.

The model is a SCRIPTED ENGINE (a labelled TEST DOUBLE, tests/support/servers.py) that answers
every call with `REPLY`; the gateway, its rendering, the CLI (a subprocess) and the environments
are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from palaestra.cli import error_line
from palaestra.sdk import Environment
from palaestra.sdk.runner import StrataError, stratified_tasks, within_noise
from palaestra.sdk.show import episode_text, pick
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server

KEY = "k-cli"
REPLY = "It is \\boxed{4}. <answer>4</answer>"


@pytest.fixture(scope="module")
def gateway(tok, tmp_path_factory):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        lambda ids, i: tok.encode(REPLY, add_special_tokens=False) + [end], stop_ids={end}
    )
    with ThreadServer(engine.app()) as eng:
        with gateway_server(eng.url, tmp_path_factory.mktemp("spool"), tok, api_key=KEY) as gw:
            yield gw


def cli(*args: str, key: str | None = KEY, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PALAESTRA_API_KEY", "PALAESTRA_TRACEBACK")}
    if key is not None:
        env["PALAESTRA_API_KEY"] = key
    if cwd is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "palaestra.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The failure's stderr, checked to be one line and the exit status non-zero."""
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# -- episodes as text ---------------------------------------------------------------------------


def test_rollout_show_prints_the_worst_episodes_as_text(gateway):
    r = cli(
        "rollout",
        *("--env", "math", "--gateway", gateway.url, "--tasks", "3", "--samples-per-task", "1"),
        *("--show", "2", "--quiet"),
    )
    assert r.returncode == 0, r.stderr
    shown = r.stdout.split("=== task ")[1:]
    assert len(shown) == 2
    for episode in shown:
        assert "Solve the problem. Put the final answer in \\boxed{}." in episode  # the system prompt
        assert "<|im_start|>user" in episode  # as the model read it, template and all
        assert "reply:\n    It is \\boxed{4}." in episode
        assert "metrics: correct" in episode and "failure/unparseable_answer 0" in episode
        assert "no forks, no ignored controls" in episode
    rewards = [float(e.split("reward ", 1)[1].split()[0].rstrip(":")) for e in shown]
    assert rewards == sorted(rewards)  # the worst first


PLUGIN = """
from palaestra.sdk import Environment, Task


class Broken(Environment):
    name = "broken"

    def tasks(self, seed):
        return [Task("t0")]

    async def rollout(self, session, task):
        await session.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return {}["missing"]
"""


def test_a_failed_episode_names_its_file_and_line_and_v_prints_the_traceback(gateway, tmp_path):
    (tmp_path / "broken_env.py").write_text(PLUGIN)
    args = ("rollout", "--env", "broken_env:Broken", "--gateway", gateway.url, "--tasks", "1")
    r = cli(*args, "--samples-per-task", "1", "--quiet", "--show", "1", cwd=tmp_path)
    assert "KeyError: 'missing'" in r.stderr and "broken_env.py:15 in rollout" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "error: KeyError: 'missing'" in r.stdout and "reply:\n    It is" in r.stdout  # --show
    r = cli(*args, "--samples-per-task", "1", "--quiet", "-v", cwd=tmp_path)
    assert "Traceback (most recent call last)" in r.stderr and 'broken_env.py", line 15' in r.stderr


def test_session_show_prints_the_turns_as_text(gateway):
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.post(
        f"{gateway.url}/sessions", json={"env": "external", "task_id": "t"}, headers=auth
    ).json()
    body = {"model": "policy", "messages": [{"role": "user", "content": "what is 2+2?"}], "max_tokens": 32}
    answer = httpx.post(
        f"{info['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {info['api_key']}"},
        json=body,
    )
    assert answer.status_code == 200, answer.text
    sid = info["session_id"]
    httpx.post(f"{gateway.url}/sessions/{sid}/reward", json={"reward": 1.0}, headers=auth).raise_for_status()
    r = cli("session", "show", sid, "--gateway", gateway.url)
    assert r.returncode == 0, r.stderr
    assert f"=== session {sid} (env external, task t): completed, reward 1.0" in r.stdout
    assert "what is 2+2?" in r.stdout and "reply:\n    It is \\boxed{4}." in r.stdout
    assert "no forks, no ignored controls" in r.stdout
    trajectory = httpx.get(f"{gateway.url}/sessions/{sid}", params={"text": "true"}, headers=auth).json()
    (turn,) = trajectory["turns"]
    assert turn["text"]["from"] == 0 and turn["text"]["reply"].startswith("It is")
    assert turn["text"]["context"].endswith("what is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_episode_text_shows_forks_and_ignored_controls():
    turn = {"turn_id": 0, "parent": None, "finish_reason": "stop", "fork_reason": None}
    fork = {**turn, "turn_id": 1, "parent": 0, "fork_reason": "edited", "fork_detail": "at token 7"}
    fork["finish_reason"] = {"type": "length", "length": 24}
    text = episode_text(
        {
            "session_id": "s",
            "env": "e",
            "task_id": "t",
            "status": "completed",
            "reward": 0.0,
            "turns": [
                {**turn, "text": {"from": 0, "context": "question", "reply": "answer"}},
                {**fork, "text": {"from": 7, "context": "tool says 3", "reply": "so 3"}},
            ],
            "forks": [{"turn_id": 1, "reason": "edited", "detail": "at token 7"}],
            "ignored_controls": {"top_k": 1},
        }
    )
    assert "turn 1, after turn 0, FORK (edited: at token 7), finish length 24" in text
    assert "new context (from token 7):\n    tool says 3" in text
    assert "forks: turn 1 (edited)" in text and "ignored controls: top_k 1" in text


def test_pick_takes_the_worst_the_best_or_a_seeded_random_choice():
    results = [
        SimpleNamespace(reward=r, status=s)
        for r, s in [(0.5, "completed"), (0.0, "failed"), (1.0, "completed")]
    ]
    assert [r.reward for r in pick(results, 2, "worst")] == [0.0, 0.5]  # the failed one first
    assert [r.reward for r in pick(results, 2, "best")] == [1.0, 0.5]
    assert pick(results, 2, "random", seed=3) == pick(results, 2, "random", seed=3)
    assert pick(results, 0, "worst") == []


# -- one line naming what to change ---------------------------------------------------------------


def test_session_reward_without_the_key_is_one_line(gateway):
    line = one_line_error(cli("session", "reward", "nope", "1", "--gateway", gateway.url, key=None))
    assert line.startswith("palaestra session: GatewayError:") and "401" in line and "--api-key" in line


def test_rollout_stops_at_the_first_refused_episode(gateway):
    line = one_line_error(
        cli("rollout", "--env", "math", "--gateway", gateway.url, "--tasks", "8", "--quiet", key="wrong")
    )
    assert "stopped at the first refused episode" in line and "401" in line and "--api-key" in line


def test_an_unreachable_gateway_is_one_line():
    line = one_line_error(
        cli("session", "new", "--env", "x", "--gateway", "http://127.0.0.1:9", "--retries", "0")
    )
    assert "gateway unreachable at http://127.0.0.1:9" in line


def test_error_line_joins_a_multi_line_message():
    assert error_line("train", ValueError("invalid config:\n  a: bad\n  b: worse")) == (
        "palaestra train: ValueError: invalid config:; a: bad; b: worse"
    )


def test_an_unknown_reasoning_gym_dataset_is_one_line():
    pytest.importorskip("reasoning_gym")
    args = ("rollout", "--env", "reasoning-gym", "--gateway", "http://127.0.0.1:9")
    line = one_line_error(cli(*args, "--env-args", '{"datasets": ["spell_backwards"]}'))
    assert "unknown reasoning-gym dataset 'spell_backwards'; the datasets are:" in line
    assert "spell_backward," in line


def test_an_unavailable_textarena_game_is_one_line_without_the_nltk_banner():
    pytest.importorskip("textarena")
    args = ("eval", "--env", "textarena", "--gateway", "http://127.0.0.1:9")
    line = one_line_error(cli(*args, "--env-args", '{"games": ["Wordle-v0"]}'))
    assert "TextArena game 'Wordle-v0' needs the NLTK data" in line and "****" not in line


# -- stratified evaluation -------------------------------------------------------------------------


def test_eval_over_two_datasets_takes_half_of_each_and_prints_both(gateway):
    pytest.importorskip("reasoning_gym")
    r = cli(
        "eval",
        *("--env", "reasoning-gym", "--gateway", gateway.url, "--tasks", "10", "--json"),
        *("--env-args", '{"datasets": ["chain_sum", "spell_backward"], "max_tokens": 16}'),
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert {k: v["n"] for k, v in summary["kinds"].items()} == {"chain_sum": 5, "spell_backward": 5}
    assert all("se" in v for v in summary["kinds"].values()) and "se" in summary
    assert "  chain_sum: accuracy " in r.stdout and " s.e. " in r.stdout
    assert "eval reasoning-gym" in r.stderr and "rollout reasoning-gym" not in r.stderr  # the bar


def test_one_kind_is_printed_too(gateway):
    args = ("eval", "--env", "judged-math", "--gateway", gateway.url, "--tasks", "2", "--quiet", "--json")
    r = cli(*args, "--env-args", '{"judge": null}')
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(summary["kinds"]) == ["arithmetic"] and summary["kinds"]["arithmetic"]["n"] == 2


class Skewed(Environment):
    """Kind "a" nine times in ten, "b" the tenth, never "c": the first tasks are all "a"."""

    name = "skewed"

    def __init__(self, kinds):
        self.named = kinds

    def kinds(self):
        return self.named

    def tasks(self, seed):
        i = 0
        while True:
            yield SimpleNamespace(task_id=f"t{i}", kind="b" if i % 10 == 9 else "a")
            i += 1

    async def rollout(self, session, task):
        return 0.0


def test_stratified_tasks_fill_each_kind_or_say_which_is_missing():
    tasks = stratified_tasks(Skewed(["a", "b"]), 5, 0)
    assert [t.kind for t in tasks] == ["a", "a", "a", "b", "b"]
    assert [t.task_id for t in tasks] == ["t0", "t1", "t2", "t9", "t19"]  # in stream order
    with pytest.raises(StrataError, match=r"too few of \['c'\]"):
        stratified_tasks(Skewed(["a", "b", "c"]), 3, 0)
    assert [t.task_id for t in stratified_tasks(Skewed(["a"]), 2, 0)] == ["t0", "t1"]


def test_math_kinds_cycle_so_stratifying_takes_the_first_tasks():
    """Training's evaluation on math is unchanged by stratifying: its kinds are already cycled."""
    from palaestra.environments.math.env import MathEnv
    from palaestra.sdk.runner import take_tasks

    for n in range(1, 8):
        assert stratified_tasks(MathEnv(), n, 0) == take_tasks(MathEnv(), n, 0)


def test_within_noise():
    assert within_noise((0.10, 20), (0.25, 20))  # the example
    assert not within_noise((0.0, 50), (1.0, 50))
    assert within_noise((0.5, 0), (1.0, 10))


# -- palaestra envs ---------------------------------------------------------------------------------


def test_envs_lists_environments_and_each_familys_members():
    r = cli("envs", key=None)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("math [palaestra.environments.math.env:MathEnv]") for line in lines)
    for family, member in (("reasoning-gym", "chain_sum"), ("textarena", "FrozenLake-v0")):
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{family}"))
        assert member in lines[i + 1] or "unavailable here" in lines[i]
    assert "palaestra envs --check" in r.stdout


def test_envs_check_says_why_a_game_is_unavailable():
    pytest.importorskip("textarena")
    from palaestra.sdk.catalog import members

    found = {
        m.name: m.unavailable for m in members("textarena", check=True, names=["FrozenLake-v0", "Wordle-v0"])
    }
    assert found["FrozenLake-v0"] == "" and "NLTK data" in found["Wordle-v0"]


def test_error_where_names_the_callers_line_not_the_librarys():
    from palaestra.sdk.show import error_where

    try:
        json.loads("{not json")  # raised inside the standard library
    except ValueError as exc:
        where = error_where(exc)
    assert where.startswith(f"{__file__}:") and where.endswith(
        "in test_error_where_names_the_callers_line_not_the_librarys"
    )


@pytest.mark.parametrize("value", ["banana", "1e308", "[]", "{}", "-1"])
def test_a_bad_text_query_value_is_a_4xx(gateway, value):
    """GET /sessions/{id}?text=... is a boolean: anything else is refused, never a 5xx."""
    import httpx

    sid = httpx.post(
        f"{gateway.url}/sessions", json={"env": "t"}, headers={"Authorization": f"Bearer {KEY}"}
    ).json()["session_id"]
    r = httpx.get(
        f"{gateway.url}/sessions/{sid}", params={"text": value}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    ok = httpx.get(
        f"{gateway.url}/sessions/{sid}", params={"text": "true"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert ok.status_code == 200 and ok.json()["turns"] == []
