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
``invalid_move`` (the game's flag for the seat), ``turns`` (the seat's model calls), and any
number the game reports in a step's info, summed as ``step/<key>``.

**Several players.** `opponent="self"` (the default): every seat is the policy, one session per
seat in the task's group (`Environment.seats`), so a two-player game's group of K episodes holds
2K samples, each seat rewarded with its own outcome. `opponent="package.module:function"`: the
policy plays seat 0 only and the function, ``(observation: str, seat: int, game_id: str) -> str``,
plays the others (a scripted player; a fixed model behind it works the same way).

An episode ends when the game does, after `max_turns` model calls per seat (reward 0, metric
``truncated``), or when a conversation outgrows the model's context (reward 0,
``failure/context_exceeded``). A game that raises mid-episode fails the episode with the game's
error (`games.GameError`). Every game is made and reset when the environment is built, so an
unknown id (the error lists those registered), a game that needs data it would download (the NLTK
word lists of Wordle, Hangman, ...) or an API key, is reported when a run's config is checked.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from palaestra.environments.episode import EpisodeLog, sampling
from palaestra.environments.textarena.games import Game, GameError, GameUnavailable, game_ids, probe
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

__all__ = ["TextArenaEnv", "TextArenaTask", "render"]

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
        """`games` a list of game ids or {id: {weight: w, players: n}}; `opponent` "self" or an
        import path of a scripted player (module docstring); `max_turns` model calls per seat."""
        if isinstance(games, str):
            games = [games]
        items = list(games.items()) if isinstance(games, Mapping) else [(g, {}) for g in games]
        if not items:
            raise ValueError("games: name at least one TextArena game id, e.g. ['FrozenLake-v0']")
        known = game_ids()
        self.games: list[tuple[str, float, int]] = []
        for game, options in items:
            options = dict(options or {})
            if game not in known:
                raise ValueError(f"unknown TextArena game {game!r}; the games are: {', '.join(known)}")
            unknown = sorted(set(options) - {"weight", "players"})
            if unknown:
                raise ValueError(f"games.{game}: unknown keys {unknown}; each takes 'weight' and 'players'")
            weight = float(options.get("weight", 1.0))
            if weight <= 0:
                raise ValueError(f"games.{game}.weight: must be positive; got {weight}")
            self.games.append((game, weight, probe(game, options.get("players"))))
        self.opponent: Callable[[str, int, str], str] | None = None
        if opponent != "self":
            from palaestra.plugins import load_object

            self.opponent = load_object(opponent, "TextArena opponent", callable_=True)
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1; got {max_turns}")
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature

    def tasks(self, seed: int) -> Iterator[TextArenaTask]:
        weights = [w for _, w, _ in self.games]
        index = 0
        while True:
            rng = random.Random(hashlib.sha256(f"textarena/{seed}/{index}".encode()).digest())
            game, _, players = self.games[rng.choices(range(len(self.games)), weights)[0]]
            game_seed = rng.randrange(2**31)
            index += 1
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
        logs = [EpisodeLog() for _ in sessions]
        chats: list[list[dict[str, Any]]] = [[{"role": "system", "content": SYSTEM}] for _ in sessions]
        turns = [0] * len(sessions)
        steps: list[dict[str, float]] = [{} for _ in range(task.players)]
        ended = ""
        while not ended:
            seat, observation = game.call("get_observation")
            text = render(observation, seat)
            if seat >= len(sessions):
                move = self.opponent(text, seat, task.game)  # type: ignore[misc]
            elif turns[seat] >= self.max_turns:
                ended = "truncated"
                break
            else:
                chats[seat].append({"role": "user", "content": text})
                try:
                    async with logs[seat].timed("model"):
                        reply = await sessions[seat].client.chat.completions.create(
                            model=self.model,
                            messages=chats[seat],
                            max_tokens=self.max_tokens,
                            **sampling(
                                sessions[seat],
                                **({} if self.temperature is None else {"temperature": self.temperature}),
                            ),
                        )
                except openai.BadRequestError as exc:
                    if getattr(exc, "code", None) != "context_length_exceeded":
                        raise
                    logs[seat].fail("context_exceeded")
                    ended = "context_exceeded"
                    break
                turns[seat] += 1
                message = reply.choices[0].message
                chats[seat].append(message.model_dump(exclude_none=True))
                move = message.content or ""
            done, info = game.call("step", move)
            for key, value in (info or {}).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    steps[seat][f"step/{key}"] = steps[seat].get(f"step/{key}", 0.0) + float(value)
            if done:
                ended = "done"
        rewards, info = game.call("close") if ended == "done" else (None, game.state.game_info)
        out = []
        for seat, log in enumerate(logs):
            value = float((rewards or {}).get(seat, 0.0))
            seat_info = (info or {}).get(seat, {})
            won = ended == "done" and (value > 0 if task.players > 1 else value >= 1.0)
            metrics = {
                "correct": float(won),
                "win": float(won),
                "draw": float(ended == "done" and task.players > 1 and value == 0),
                "invalid_move": float(bool(seat_info.get("invalid_move"))),
                "turns": float(turns[seat]),
                "truncated": float(ended == "truncated"),
                **steps[seat],
            }
            out.append(Reward(value, log.metrics(**metrics)))
        return out


__all__ += ["GameError", "GameUnavailable"]
