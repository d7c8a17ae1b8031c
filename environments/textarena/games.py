"""TextArena games made safely: no download at run time, each game's own random state, and a
probe that says whether a game can be played here and with how many players.

TextArena seeds Python's process-wide `random` in every game's reset and draws from it while the
game runs, so concurrent episodes in one event loop would take each other's numbers. `Game` keeps
one random state per game and swaps it in around every call into the game, so an episode plays the
same for the same seed however many run beside it.

Some games (Wordle, Hangman, WordLadder, Codenames, SpellingBee, ...) call `nltk.download` when
their module is imported; nothing is downloaded here: `no_downloads` answers such a call from the
local NLTK data when it is there and raises `GameUnavailable` naming the data otherwise.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Game",
    "GameError",
    "GameUnavailable",
    "Observation",
    "Outcome",
    "Step",
    "game_ids",
    "make_game",
    "no_downloads",
    "probe",
]

MAX_PLAYERS = 6
NLTK_PLACES = ("corpora", "taggers", "tokenizers", "chunkers", "models", "grammars", "misc")


class GameUnavailable(RuntimeError):
    """A game that cannot be played on this machine (data it would download, a key it needs)."""


class GameError(RuntimeError):
    """A game that raised during an episode: the episode fails with this reason."""


def game_ids() -> list[str]:
    """TextArena's registered game ids, without the ``-raw`` and ``-train`` wrapper variants."""
    from textarena.envs.registration import ENV_REGISTRY

    return [k for k in ENV_REGISTRY if not k.endswith(("-raw", "-train"))]


def _have_nltk_data(name: str) -> bool:
    import nltk

    for place in NLTK_PLACES:
        for suffix in ("", ".zip"):
            with contextlib.suppress(LookupError):
                nltk.data.find(f"{place}/{name}{suffix}")
                return True
    return False


@contextlib.contextmanager
def no_downloads(game: str) -> Iterator[None]:
    """While a game is made: `nltk.download` finds its data locally or raises `GameUnavailable`."""
    import nltk

    real = nltk.download

    def local_only(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        names = [info_or_id] if isinstance(info_or_id, str) else list(info_or_id or [])
        missing = [n for n in names if not _have_nltk_data(str(n))]
        if missing:
            raise GameUnavailable(
                f"TextArena game {game!r} needs the NLTK data {', '.join(map(repr, missing))}, which "
                "it would download from the NLTK hub at run time; nothing is downloaded here (put the "
                "data in a directory on NLTK_DATA to play it)"
            )
        return True

    nltk.download = local_only
    try:
        yield
    finally:
        nltk.download = real


def make_game(game_id: str) -> Any:
    """The raw game (no observation wrappers: the environment renders observations itself);
    `GameUnavailable` with the reason when it cannot be made here."""
    import textarena as ta

    try:
        with no_downloads(game_id), contextlib.redirect_stdout(io.StringIO()):
            return ta.make(f"{game_id}-raw")
    except GameUnavailable:
        raise
    except LookupError as exc:  # NLTK data looked up without a download call: its banner, as one line
        found = re.search(r"Resource '?([\w./-]+?)'? not found", str(exc))
        data = repr(found.group(1)) if found else "data"
        raise GameUnavailable(
            f"TextArena game {game_id!r} needs the NLTK data {data}, which is not installed here (put "
            "the data in a directory on NLTK_DATA to play it)"
        ) from None
    except Exception as exc:  # a game that needs an API key, a file the wheel lacks, newer Python
        raise GameUnavailable(
            f"TextArena game {game_id!r} cannot be made here: {type(exc).__name__}: {exc}"
        ) from exc


@dataclass(frozen=True)
class Observation:
    """Whose move it is and what that player has been shown since its last move."""

    seat: int
    messages: list[tuple[int, str, Any]]
    """``(sender, text, kind)``: sender -1 is the game, otherwise a player's seat."""


@dataclass(frozen=True)
class Step:
    """What a move did: whether the game ended, and the numbers and flags the game reported."""

    done: bool
    info: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """Each seat's reward (empty while the game has not ended) and the game's notes per seat
    (``invalid_move``, ``reason``, ...)."""

    rewards: dict[int, float]
    info: dict[int, dict[str, Any]]


@dataclass
class Game:
    """One episode's game with its own random state (module docstring): `observe`, `step` and
    `close` are the game's own calls, typed."""

    game_id: str
    players: int
    seed: int
    env: Any = None
    _state: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.env = make_game(self.game_id)
        self._state = random.Random(self.seed).getstate()
        self.call("reset", num_players=self.players, seed=self.seed)

    def observe(self) -> Observation:
        """The player to move and its new observations."""
        seat, messages = self.call("get_observation")
        return Observation(seat, list(messages))

    def step(self, move: str) -> Step:
        """`move` played by the player to move, as written."""
        done, info = self.call("step", move)
        return Step(bool(done), dict(info or {}))

    def close(self) -> Outcome:
        """The ended game's rewards; call it once `step` said done."""
        rewards, info = self.call("close")
        return Outcome({int(k): float(v) for k, v in (rewards or {}).items()}, dict(info or {}))

    def unfinished(self) -> Outcome:
        """The notes of a game stopped before its end (no rewards)."""
        return Outcome({}, dict(self.env.state.game_info or {}))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(...)`` with this game's random state; what it raises is a `GameError`.
        The typed calls above go through it (a test double may wrap it)."""
        outer = random.getstate()
        random.setstate(self._state)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                return getattr(self.env, method)(*args, **kwargs)
        except Exception as exc:
            raise GameError(
                f"TextArena game {self.game_id!r} raised in {method}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._state = random.getstate()
            random.setstate(outer)

    @property
    def state(self) -> Any:
        return self.env.state


def probe(game_id: str, players: int | None = None) -> int:
    """The number of players `game_id` is played with here (`players`, else the fewest it accepts,
    1 to 6); `GameUnavailable` naming why when it cannot be."""
    counts = [players] if players is not None else list(range(1, MAX_PLAYERS + 1))
    errors = []
    for n in counts:
        try:
            Game(game_id, n, seed=0).observe()
            return n
        except GameUnavailable:
            raise
        except GameError as exc:
            errors.append(f"{n} players: {exc.__cause__}")
    raise GameUnavailable(f"TextArena game {game_id!r} could not be reset: {'; '.join(errors)}")
