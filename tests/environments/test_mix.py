"""The `mix` family: tasks drawn from several environments by weight, reproducibly, each task's kind
its family; a rollout through the real gateway over reasoning-gym and a TextArena game scored per
family; a member that cannot be built named when the run's config loads.

The model is a SCRIPTED ENGINE (a labelled TEST DOUBLE, tests/support/servers.py) that answers each
prompt correctly; the environments, the gateway, its rendering and the openai client are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is an extra: make install installs it")
pytest.importorskip("textarena", reason="textarena is an extra: make install installs it")

from palaestra.environments.mix.env import MixEnv  # noqa: E402
from palaestra.environments.textarena.games import Game  # noqa: E402
from palaestra.sdk import GatewayClient, run_rollouts  # noqa: E402
from palaestra.sdk.scoring import score  # noqa: E402
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server  # noqa: E402

MEMBERS = {
    "reasoning-gym": {"weight": 3, "args": {"datasets": ["chain_sum"], "size": 50}},
    "textarena": {"args": {"games": ["GuessTheNumber-v0"]}},
}


def test_tasks_are_drawn_by_weight_reproducibly_and_carry_their_family():
    env = MixEnv(MEMBERS)
    first = list(itertools.islice(env.tasks(0), 40))
    assert [t.task_id for t in first] == [t.task_id for t in itertools.islice(env.tasks(0), 40)]
    kinds = [t.kind for t in first]
    assert 20 < kinds.count("reasoning-gym") < 40 and "textarena" in kinds
    assert all(t.task_id.startswith(f"{t.kind}/") for t in first)
    assert env.seats(next(t for t in first if t.kind == "textarena")) == 1  # GuessTheNumber: one player


@pytest.mark.parametrize(
    ("members", "needle"),
    [
        ({"reasoning-gym": {"args": {"datasets": ["nope"]}}}, "environments.reasoning-gym"),
        ({"textarena": {"weight": 0}}, "environments.textarena.weight"),
        ({"math": {"argz": {}}}, "unknown keys ['argz']"),
        ({"mix": {}}, "cannot hold another mix"),
    ],
)
def test_a_member_that_cannot_be_built_is_named_when_the_run_config_loads(tmp_path, members, needle):
    from palaestra.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"env": {"name": "mix", "args": {"environments": members}}}))
    with pytest.raises(ConfigError, match="env.args") as err:
        load_config(str(path), [])
    assert needle in str(err.value)


def test_a_mixed_rollout_through_the_gateway_is_scored_per_family(tok, tmp_path):
    env = MixEnv(MEMBERS)
    # the stream's first game and first 5 arithmetic tasks: the agent tells a game by its secret
    stream = env.tasks(2)
    game = next(t for t in stream if t.kind == "textarena")
    tasks = [game, *itertools.islice((t for t in env.tasks(2) if t.kind == "reasoning-gym"), 5)]
    secret = Game(game.task.game, 1, game.task.seed).state.game_state["game_number"]
    answers = {t.task.question: t.task.entry["answer"] for t in tasks[1:]}
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(ids, index):
        prompt = tok.decode(ids)
        if "[GAME]" in prompt:
            text = f"[{secret}]"
        else:
            text = "<answer>" + next(a for q, a in answers.items() if q in prompt) + "</answer>"
        return tok.encode(text, add_special_tokens=False) + [end]

    with ThreadServer(ScriptedEngine(script, stop_ids={end}).app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok, api_key="k") as gw:

            async def run():
                client = GatewayClient(gw.url, "k")
                try:
                    return await run_rollouts(env, client, tasks, samples_per_task=1, progress=False)
                finally:
                    await client.close()

            summary = asyncio.run(run())
    assert summary.statuses == {"completed": 6} and summary.rewards == [1.0] * 6
    scores = score(tasks, summary.results)
    assert scores["accuracy/reasoning-gym"] == 1.0 and scores["accuracy/textarena"] == 1.0
    assert (scores["tasks/textarena"], scores["tasks/reasoning-gym"]) == (1.0, 5.0)


def test_the_example_config_loads_and_builds_its_three_families():
    from palaestra.config import load_config
    from palaestra.sdk.registry import load_environment

    cfg = load_config("configs/mix.yaml")
    env = load_environment(cfg.env.name, **cfg.env.args)
    assert [name for name, _, _ in env.members] == ["math", "reasoning-gym", "textarena"]
    assert {t.kind for t in itertools.islice(env.tasks(0), 30)} == {"math", "reasoning-gym", "textarena"}
