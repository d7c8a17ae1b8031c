"""The building blocks of the reasoning-gym and TextArena families: their typed options (one-line
errors naming the key), TextArena's typed game calls, its `Seat` record (step numbers summed,
rewards and metrics from a typed end state), and a conversation that outgrows the context ending a
game's episode through the shared `model_turn` (the real gateway, a SCRIPTED ENGINE as the model:
a labelled TEST DOUBLE from tests/support/servers.py)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is an extra: make install installs it")
pytest.importorskip("textarena", reason="textarena is an extra: make install installs it")

from palaestra.environments.episode import EpisodeLog  # noqa: E402
from palaestra.environments.reasoning_gym.env import (  # noqa: E402
    DatasetError,
    DatasetOptions,
    ReasoningGymEnv,
    ReasoningGymOptions,
)
from palaestra.environments.textarena.env import Seat, TextArenaEnv, TextArenaOptions  # noqa: E402
from palaestra.environments.textarena.games import Game, Observation, Outcome, Step  # noqa: E402
from palaestra.sdk.mix import Entry  # noqa: E402
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server  # noqa: E402
from tests.support.sessions import rollouts  # noqa: E402


def test_reasoning_gym_reads_its_arguments_into_typed_options():
    env = ReasoningGymEnv({"chain_sum": {"weight": 2, "config": None}, "spell_backward": {}}, size=5)
    assert isinstance(env.options, ReasoningGymOptions) and env.options.size == 5
    assert list(env.options.datasets) == [
        Entry("chain_sum", 2.0, DatasetOptions()),
        Entry("spell_backward", 1.0, DatasetOptions()),
    ]
    assert {t.kind for t in itertools.islice(env.tasks(0), 20)} == {"chain_sum", "spell_backward"}


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ({"datasets": {"chain_sum": {"config": 3}}}, DatasetError, "datasets.chain_sum.config: must be a mapping; got 3"),
        ({"datasets": {"chain_sum": 3}}, DatasetError, "datasets: each entry is a name or name: {weight: w, config: {...}}; got 'chain_sum': 3"),
        ({"size": "10"}, ValueError, "size: must be an integer; got '10'"),
        ({"size": 0}, ValueError, "size: must be >= 1; got 0"),
        ({"max_tokens": 1.5}, ValueError, "max_tokens: must be an integer; got 1.5"),
    ],
)  # fmt: skip
def test_reasoning_gym_option_errors_are_one_line_naming_the_key(args, error, message):
    with pytest.raises(error) as err:
        ReasoningGymEnv(**{"datasets": ["chain_sum"], **args})
    assert str(err.value) == message


def test_textarena_reads_its_arguments_into_typed_options():
    env = TextArenaEnv({"TicTacToe-v0": {"weight": 2}, "GuessTheNumber-v0": {"players": 1}}, max_turns=3)
    assert isinstance(env.options, TextArenaOptions) and env.options.max_turns == 3
    # each game's entry holds the players it is played with: TicTacToe's fewest is 2
    assert list(env.games) == [Entry("TicTacToe-v0", 2.0, 2), Entry("GuessTheNumber-v0", 1.0, 1)]
    for name, message in [
        (
            {"TicTacToe-v0": {"players": "2"}},
            "games.TicTacToe-v0.players: must be an integer or None; got '2'",
        ),
        ({"TicTacToe-v0": {"weight": 0}}, "games.TicTacToe-v0.weight: must be a positive number; got 0"),
    ]:
        with pytest.raises(ValueError) as err:
            TextArenaEnv(name)
        assert str(err.value) == message
    with pytest.raises(ValueError, match="^max_turns: must be >= 1; got 0$"):
        TextArenaEnv(["TicTacToe-v0"], max_turns=0)
    with pytest.raises(ValueError, match="^temperature: must be a number or None; got 'hot'$"):
        TextArenaEnv(["TicTacToe-v0"], temperature="hot")  # type: ignore[arg-type]


def test_a_game_is_driven_by_typed_calls():
    game = Game("TicTacToe-v0", 2, seed=5)
    seen = game.observe()
    assert isinstance(seen, Observation) and seen.seat == 0 and seen.messages
    assert all(sender == -1 for sender, _, _ in seen.messages)  # only the game has spoken
    for move in ["[4]", "[0]", "[3]", "[1]"]:
        step = game.step(move)
        assert step == Step(False, step.info)
    assert game.unfinished().rewards == {} and set(game.unfinished().info) == {0, 1}
    assert game.step("[5]").done  # seat 0 completes the middle row
    outcome = game.close()
    assert outcome.rewards == {0: 1.0, 1: -1.0} and not outcome.info[0]["invalid_move"]


def test_a_seat_sums_its_step_numbers_and_scores_the_end_state():
    seat = Seat(session=None)  # type: ignore[arg-type]
    assert seat.messages[0]["role"] == "system" and seat.turns == 0
    seat.add_step({"score": 2, "ratio": 0.5, "flag": True, "note": "x"})
    seat.add_step({"score": 1})
    assert seat.steps == {"step/score": 3.0, "step/ratio": 0.5}  # bools and text are not numbers
    seat.turns = 4
    won = Outcome({0: 1.0, 1: -1.0}, {0: {"invalid_move": False}, 1: {"invalid_move": True}})
    first = seat.reward(0, "done", won, players=2)
    assert first.value == 1.0 and first.metrics["win"] == 1.0 and first.metrics["correct"] == 1.0
    assert first.metrics["turns"] == 4.0 and first.metrics["step/score"] == 3.0
    second = Seat(session=None).reward(1, "done", won, players=2)  # type: ignore[arg-type]
    assert second.value == -1.0 and second.metrics["win"] == 0.0 and second.metrics["invalid_move"] == 1.0
    draw = Seat(session=None).reward(0, "done", Outcome({0: 0.0, 1: 0.0}, {}), players=2)  # type: ignore[arg-type]
    assert draw.metrics["draw"] == 1.0 and draw.metrics["win"] == 0.0
    partial = Seat(session=None).reward(0, "done", Outcome({0: 0.5}, {}), players=1)  # type: ignore[arg-type]
    assert partial.value == 0.5 and partial.metrics["win"] == 0.0  # one player: only 1 is solved
    cut = Seat(session=None, log=EpisodeLog()).reward(0, "truncated", Outcome({}, {}), players=1)  # type: ignore[arg-type]
    assert cut.value == 0.0 and cut.metrics["truncated"] == 1.0 and cut.metrics["draw"] == 0.0


def test_a_game_whose_conversation_outgrows_the_context_ends_with_reward_0(tok, tmp_path):
    env = TextArenaEnv(["GuessTheNumber-v0"], max_turns=12)
    task = next(iter(env.tasks(0)))
    secret = Game(task.game, 1, task.seed).state.game_state["game_number"]
    wrong = f"[{1 if secret != 1 else 2}]"  # a valid guess that does not win: the game goes on
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def play(context_length):
        engine = ScriptedEngine(
            lambda ids, i: tok.encode(wrong, add_special_tokens=False) + [end], stop_ids={end}
        )
        with ThreadServer(engine.app()) as eng:
            spool = tmp_path / f"spool-{context_length}"
            with gateway_server(eng.url, spool, tok, api_key="k", context_length=context_length) as gw:
                (result,) = rollouts(gw.url, "k", env, [task]).results
        assert result.status == "completed", result.error
        return result, engine

    roomy, engine = play(None)
    assert roomy.metrics["turns"] >= 2.0 and roomy.metrics["failure/context_exceeded"] == 0.0
    first_prompt = len(engine.exchanges[0].body["input_ids"])
    tight, engine = play(first_prompt + 16)  # the first call fits, the second does not
    assert len(engine.exchanges) == 1
    assert tight.reward == 0.0 and tight.metrics["failure/context_exceeded"] == 1.0
    assert tight.metrics["turns"] == 1.0 and tight.metrics["win"] == 0.0 and tight.metrics["truncated"] == 0.0
