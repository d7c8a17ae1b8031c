"""`textarena`: TextArena's games (PyPI `textarena`, `pip install -e .[textarena]`; `make install`
installs it) played through the gateway, one game move per model turn.

    palaestra rollout --env textarena --gateway $GW --tasks 8 \\
        --env-args '{"games": ["FrozenLake-v0", "TicTacToe-v0"]}'

Each observation the game sends a player since its last move is that player's next user turn
(``[GAME] ...`` lines, the other players' moves as ``[Player 1] ...``); the model's reply is the
move, passed to the game as written (the games read the bracketed token). When the game ends, a
seat's reward is its outcome as the game scores it (single-player games 0-1, e.g. FrozenLake's
share of the way; two-player games 1 win, 0 draw, -1 loss). Metrics: ``win`` (also ``correct``,
what evaluations count: a single-player game solved, reward 1; a game of several won), ``draw``,
``invalid_move`` (the game's flag for the seat: a move it could not read or that broke its rules,
scored by the game as a loss; also ``failure/unparseable_answer``, as every family names it), ``turns`` (the seat's model calls), and any
number the game reports in a step's info, summed as ``step/<key>``.

**Several players.** `opponent="self"` (the default): every seat is the policy, one session per
seat in the task's group (`Environment.seats`), so a two-player game's group of K episodes holds
2K samples, each seat rewarded with its own outcome. `opponent="package.module:function"`: the
policy plays seat 0 only and the function, ``(observation: str, seat: int, game_id: str) -> str``,
plays the others (a scripted player; a fixed model behind it works the same way).

Each seat the policy plays is a `Seat` (its session, conversation, log, turns and step numbers);
a model move is one `episode.model_turn`, the move played through `Game`'s typed calls. An
episode ends (`End`) when the game does, after `max_turns` model calls per seat (reward 0, metric
``truncated``), or when a conversation outgrows the model's context (reward 0,
``failure/context_exceeded``). A game that raises mid-episode fails the episode with the game's
error (`games.GameError`). Every game is made and reset when the environment is built, so an
unknown id (the error lists those registered), a game that needs data it would download (the NLTK
word lists of Wordle, Hangman, ...) or an API key, is reported when a run's config is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from palaestra.environments.episode import EpisodeLog, model_turn
from palaestra.environments.textarena.games import (
    Game,
    GameError,
    GameUnavailable,
    Outcome,
    game_ids,
    probe,
)
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.mix import WeightedMix
from palaestra.sdk.options import OptionError, read_options
from palaestra.sdk.session import Session

__all__ = [
    "End",
    "GameOptions",
    "Seat",
    "TextArenaEnv",
    "TextArenaOptions",
    "TextArenaTask",
    "render",
    "GameError",
    "GameUnavailable",
]

SYSTEM = (
    "You are playing a text game. Follow the game's instructions and reply with your move in exactly "
    "the format the game asks for (usually one bracketed token such as [up] or [4]); put nothing "
    "else in square brackets."
)


@dataclass(frozen=True)
class TextArenaTask:
    task_id: str
    """``<game>-s<seed>``: the game and the seed it is reset with."""
    kind: str
    """The game id: accuracy is reported per game."""
    game: str
    seed: int
    players: int


def render(observation: Sequence[tuple[int, str, Any]], seat: int) -> str:
    """A player's new observations as one user turn: the game's messages as ``[GAME] ...``, other
    players' moves as ``[Player i] ...``; the player's own moves (already its replies) left out."""
    lines = []
    for sender, message, _kind in observation:
        if sender == seat:
            continue
        lines.append(f"[GAME] {message}" if sender < 0 else f"[Player {sender}] {message}")
    return "\n".join(lines)


@dataclass(frozen=True)
class GameOptions:
    """A game's entry in `games` besides its weight."""

    players: int | None = None
    """Players the game is played with (None: the fewest it accepts here, 1 to 6)."""


@dataclass(frozen=True)
class TextArenaOptions:
    """`TextArenaEnv`'s arguments, checked (module docstring)."""

    games: WeightedMix[int]
    """The games, each entry's value the number of players it is played with."""
    opponent: str = "self"
    """"self" (the policy plays every seat) or the import path of a scripted player."""
    max_turns: int = 32
    """Model calls per seat, at most."""
    max_tokens: int = 128
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise OptionError("max_turns", f"must be >= 1; got {self.max_turns}")


End = Literal["done", "truncated", "context_exceeded"]
"""Why an episode ended: the game ended; a seat reached `max_turns`; a seat's conversation outgrew
the model's context."""


@dataclass
class Seat:
    """A seat the policy plays: its session, its conversation and what it has done so far."""

    session: Session
    messages: list[dict[str, Any]] = field(default_factory=lambda: [{"role": "system", "content": SYSTEM}])
    log: EpisodeLog = field(default_factory=EpisodeLog)
    turns: int = 0
    """Model calls made."""
    steps: dict[str, float] = field(default_factory=dict)
    """The numbers the game reported in this seat's steps, summed as ``step/<key>``."""

    def add_step(self, info: Mapping[str, Any]) -> None:
        for key, value in info.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.steps[f"step/{key}"] = self.steps.get(f"step/{key}", 0.0) + float(value)

    def reward(self, position: int, end: End, outcome: Outcome, players: int) -> Reward:
        """Seat `position`'s reward and metrics (module docstring) once the episode has ended."""
        value = outcome.rewards.get(position, 0.0)
        won = end == "done" and (value > 0 if players > 1 else value >= 1.0)
        invalid = float(bool(outcome.info.get(position, {}).get("invalid_move")))
        metrics = {
            "correct": float(won),
            "win": float(won),
            "draw": float(end == "done" and players > 1 and value == 0),
            "invalid_move": invalid,
            "failure/unparseable_answer": invalid,  # as every family names a move it cannot read
            "turns": float(self.turns),
            "truncated": float(end == "truncated"),
            **self.steps,
        }
        return Reward(value, self.log.metrics(**metrics))


class TextArenaEnv(Environment):
    name = "textarena"

    def __init__(
        self,
        games: Sequence[str] | Mapping[str, Any] = ("FrozenLake-v0",),
        opponent: str = "self",
        max_turns: int = 32,
        max_tokens: int = 128,
        temperature: float | None = None,
    ):
        """`games` a list of game ids or {id: {weight: w, players: n}}; the others are
        `TextArenaOptions`' fields (module docstring)."""
        mix = WeightedMix.parse(
            games,
            GameOptions,
            key="games",
            what="TextArena game id",
            example="['FrozenLake-v0']",
            salt=self.name,
        )
        known = game_ids()
        for entry in mix:
            if entry.name not in known:
                raise ValueError(f"unknown TextArena game {entry.name!r}; the games are: {', '.join(known)}")
        self.options = read_options(
            TextArenaOptions,
            {
                "games": mix.map(lambda entry: probe(entry.name, entry.value.players)),
                "opponent": opponent,
                "max_turns": max_turns,
                "max_tokens": max_tokens,
                "temperature": temperature,
            },
        )
        self.games = self.options.games
        self.opponent: Callable[[str, int, str], str] | None = None
        if self.options.opponent != "self":
            from palaestra.plugins import load_object

            self.opponent = load_object(self.options.opponent, "TextArena opponent", callable_=True)
        options = self.options
        self.max_turns, self.max_tokens, self.temperature = (
            options.max_turns,
            options.max_tokens,
            options.temperature,
        )

    def kinds(self) -> list[str]:
        return self.games.names

    def tasks(self, seed: int) -> Iterator[TextArenaTask]:
        for draw in self.games.draws(seed):
            game, _, players = draw.entry
            game_seed = draw.rng.randrange(2**31)
            yield TextArenaTask(f"{game}-s{game_seed}", game, game, game_seed, players)

    def seats(self, task: TextArenaTask) -> int:
        return task.players if self.opponent is None else 1

    async def rollout(self, session: Session, task: TextArenaTask) -> Reward:
        return (await self._episode([session], task))[0]

    async def play(self, sessions: list[Session], task: TextArenaTask) -> list[Reward]:
        return await self._episode(sessions, task)

    async def _episode(self, sessions: list[Session], task: TextArenaTask) -> list[Reward]:
        """The game from reset to its end: seat i < len(sessions) is the policy on sessions[i], the
        others the scripted opponent."""
        game = Game(task.game, task.players, task.seed)
        seats = [Seat(session) for session in sessions]
        end: End | None = None
        while end is None:
            observation = game.observe()
            text = render(observation.messages, observation.seat)
            if observation.seat >= len(seats):
                move = self.opponent(text, observation.seat, task.game)  # type: ignore[misc]
                end = "done" if game.step(move).done else None  # its step info is not reported
            else:
                seat = seats[observation.seat]
                end = await self._model_move(game, seat, text)
        outcome = game.close() if end == "done" else game.unfinished()
        return [seat.reward(i, end, outcome, task.players) for i, seat in enumerate(seats)]

    async def _model_move(self, game: Game, seat: Seat, text: str) -> End | None:
        """`seat`'s model shown `text` and its reply played; why the episode ended, or None."""
        if seat.turns >= self.max_turns:
            return "truncated"
        seat.messages.append({"role": "user", "content": text})
        message = await model_turn(
            seat.session,
            seat.messages,
            model=self.model,
            max_tokens=self.max_tokens,
            log=seat.log,
            temperature=self.temperature,
        )
        if message is None:
            return "context_exceeded"
        seat.turns += 1
        step = game.step(message.content or "")
        seat.add_step(step.info)
        return "done" if step.done else None
