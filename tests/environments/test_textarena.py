"""The TextArena family through the real gateway: a single-player game won by an agent that plays
correctly (reward 1) and lost by one that does not (reward 0), a two-player game in self-play (two
sessions of one group, each seat rewarded with its own outcome), a fixed scripted opponent, a game
that raises mid-episode, and the errors a run's config gets for games that cannot be played here.

The model is a SCRIPTED ENGINE (a labelled TEST DOUBLE, tests/support/servers.py) answering with
moves the test chose; the games, the gateway, its rendering and the openai client are real.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("textarena", reason="textarena is an extra: make install installs it")

from palaestra.environments.textarena.env import TextArenaEnv, TextArenaTask  # noqa: E402
from palaestra.environments.textarena.games import Game, GameUnavailable  # noqa: E402
from palaestra.sdk import GatewayClient, run_rollouts  # noqa: E402
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server  # noqa: E402

KEY = {"Authorization": "Bearer k"}


def scripted(tok, reply) -> ScriptedEngine:
    """`reply(prompt_text, call_index) -> str` as the model."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return ScriptedEngine(
        lambda ids, i: tok.encode(reply(tok.decode(ids), i), add_special_tokens=False) + [end], stop_ids={end}
    )


def rollouts(tok, tmp_path, env, tasks, reply, samples_per_task=1):
    with ThreadServer(scripted(tok, reply).app()) as eng:
        with gateway_server(eng.url, tmp_path / "spool", tok, api_key="k") as gw:

            async def run():
                client = GatewayClient(gw.url, "k")
                try:
                    return await run_rollouts(
                        env, client, tasks, samples_per_task=samples_per_task, concurrency=1, progress=False
                    )
                finally:
                    await client.close()

            summary = asyncio.run(run())
            sessions = {
                r.session_id: httpx.get(f"{gw.url}/sessions/{r.session_id}", headers=KEY).json()
                for r in summary.results
                if r.session_id
            }
    return summary, sessions


@pytest.mark.parametrize("right", [True, False], ids=["correct-agent", "wrong-agent"])
def test_a_single_player_game_scores_its_outcome(tok, tmp_path, right):
    env = TextArenaEnv(["GuessTheNumber-v0"], max_turns=12)
    task = next(iter(env.tasks(0)))
    secret = Game(task.game, 1, task.seed).state.game_state["game_number"]  # the oracle's knowledge

    summary, sessions = rollouts(tok, tmp_path, env, [task], lambda p, i: f"[{secret if right else 0}]")
    (result,) = summary.results
    assert result.status == "completed", result.error
    assert result.reward == (1.0 if right else 0.0)
    assert result.metrics["win"] == float(right) and result.metrics["invalid_move"] == float(not right)
    # one guess wins; an invalid guess is allowed once (TextArena's error allowance), the second loses
    assert result.metrics["turns"] == (1.0 if right else 2.0)
    (trajectory,) = sessions.values()
    assert trajectory["finished"] and trajectory["reward"] == result.reward


def test_self_play_is_two_sessions_of_one_group_rewarded_per_seat(tok, tmp_path):
    """TicTacToe, both seats the policy: seat 0 plays the middle row (3, 4, 5) and wins."""
    env = TextArenaEnv(["TicTacToe-v0"])
    task = TextArenaTask("TicTacToe-v0-s5", "TicTacToe-v0", "TicTacToe-v0", 5, 2)
    assert env.seats(task) == 2
    moves = ["[4]", "[0]", "[3]", "[1]", "[5]"]  # calls alternate seat 0, seat 1 (one episode)
    prompts: list[str] = []
    summary, sessions = rollouts(tok, tmp_path, env, [task], lambda p, i: prompts.append(p) or moves[i])
    assert [r.status for r in summary.results] == ["completed", "completed"]
    assert [r.reward for r in summary.results] == [1.0, -1.0]
    assert [r.metrics["turns"] for r in summary.results] == [3.0, 2.0]
    assert len({r.group_id for r in summary.results}) == 1 and len(sessions) == 2
    seats = [sessions[r.session_id]["metadata"]["seat"] for r in summary.results]
    assert seats == [0, 1]
    # each seat's conversation holds the other's moves as observations and its own as its replies
    seat1 = prompts[3]  # seat 1's second call
    assert "[Player 0] [4]" in seat1 and "[Player 0] [3]" in seat1 and "[Player 1]" not in seat1
    assert "[Player 0]" not in prompts[0] and "[Player 1] [0]" in prompts[2]


def fixed_opponent(observation: str, seat: int, game_id: str) -> str:
    """A scripted TicTacToe player: the first free cell of 0, 1, 2, 6, 7, 8."""
    for cell in (0, 1, 2, 6, 7, 8):
        if f"[{cell}]" not in FIXED_SEEN and f"cell {cell}" not in observation:
            FIXED_SEEN.append(f"[{cell}]")
            return f"[{cell}]"
    return "[8]"


FIXED_SEEN: list[str] = []


def test_a_fixed_opponent_plays_the_other_seat(tok, tmp_path):
    FIXED_SEEN.clear()
    env = TextArenaEnv(["TicTacToe-v0"], opponent="tests.environments.test_textarena:fixed_opponent")
    task = TextArenaTask("TicTacToe-v0-s5", "TicTacToe-v0", "TicTacToe-v0", 5, 2)
    assert env.seats(task) == 1
    moves = ["[4]", "[3]", "[5]"]
    summary, sessions = rollouts(tok, tmp_path, env, [task], lambda p, i: moves[i])
    (result,) = summary.results
    assert result.status == "completed" and result.reward == 1.0 and FIXED_SEEN == ["[0]", "[1]"]


def test_a_game_that_raises_mid_episode_fails_the_episode_with_its_reason(tok, tmp_path, monkeypatch):
    env = TextArenaEnv(["GuessTheNumber-v0"])
    task = next(iter(env.tasks(0)))
    real = Game.call

    def broken(self, method, *args, **kwargs):
        if method == "step":
            self.env.step = lambda action: 1 / 0
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(Game, "call", broken)
    summary, sessions = rollouts(tok, tmp_path, env, [task], lambda p, i: "[3]")
    (result,) = summary.results
    assert result.status == "failed"
    assert "GameError" in result.error and "raised in step: ZeroDivisionError" in result.error
    assert sessions[result.session_id]["status"] == "failed"


@pytest.mark.parametrize(
    ("games", "needle"),
    [
        (["NoSuchGame-v0"], "the games are: 2048-v0-ultra-easy"),
        (["Wordle-v0"], "needs the NLTK data 'averaged_perceptron_tagger_eng'"),
        (["Hangman-v0"], "needs the NLTK data 'words'"),
        (["TwentyQuestions-v0"], "OPENROUTER_API_KEY"),
    ],
)
def test_games_that_cannot_be_played_are_named_when_the_run_config_loads(tmp_path, games, needle):
    from palaestra.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"env": {"name": "textarena", "args": {"games": games}}}))
    with pytest.raises(ConfigError, match="env.args") as err:
        load_config(str(path), [])
    assert needle in str(err.value)
    with pytest.raises((ValueError, GameUnavailable)):
        TextArenaEnv(games)


def test_a_game_plays_the_same_for_its_seed_whatever_runs_beside_it():
    import random

    a = Game("Minesweeper-v0-small", 1, seed=11)
    random.seed(999)  # another game (or anything else) moving the process-wide generator
    b = Game("Minesweeper-v0-small", 1, seed=11)
    for game in (a, b):
        game.call("step", "[3 3]")
    assert a.state.game_state == b.state.game_state
