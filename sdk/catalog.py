"""What can be run here: `palaestra envs`.

    palaestra envs            # the built-in environments, and each family's datasets or games
    palaestra envs --check    # also builds every dataset and game (~50 s) and says why any cannot be

An environment is unavailable when its module does not import (an optional package missing: the
reasoning-gym and TextArena families are the `reasoning-gym` and `textarena` extras). A family's
members are reasoning-gym's datasets and TextArena's games; with ``--check`` each is built (a
dataset and its first item, a game made and reset) and one that fails is listed with the reason:
NLTK data that is not installed, an API key a game needs, a game that does not import here.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from palaestra.sdk.registry import BUILTIN, environment_class

__all__ = ["FAMILIES", "Member", "catalog_lines", "members"]


@dataclass(frozen=True)
class Member:
    """A family's dataset or game; `unavailable` says why it cannot be run here ('' when it can,
    or when it was not checked)."""

    name: str
    unavailable: str = ""


def _rg_names() -> list[str]:
    from palaestra.environments.reasoning_gym.env import dataset_names

    return dataset_names()


def _rg_check(name: str) -> None:
    from palaestra.environments.reasoning_gym.env import build_dataset

    build_dataset(name, {}, 0, 4)[0]


def _ta_names() -> list[str]:
    from palaestra.environments.textarena.games import game_ids

    return game_ids()


def _ta_check(name: str) -> None:
    from palaestra.environments.textarena.games import probe

    probe(name)


FAMILIES: dict[str, tuple[str, Callable[[], list[str]], Callable[[str], None]]] = {
    "reasoning-gym": ("datasets", _rg_names, _rg_check),
    "textarena": ("games", _ta_names, _ta_check),
}
"""Environment name -> (what its members are called, their names, a check that raises why one
cannot be run)."""


def members(family: str, check: bool = False, names: Sequence[str] | None = None) -> list[Member]:
    """The members of `family` (all, or `names`), each built when `check` (module docstring)."""
    what, list_names, build = FAMILIES[family]
    out = []
    for name in list_names() if names is None else names:
        reason = ""
        if check:
            try:
                with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                    warnings.simplefilter("ignore")
                    build(name)
            except Exception as exc:
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        out.append(Member(name, reason))
    return out


def catalog_lines(check: bool = False) -> list[str]:
    """`palaestra envs`'s output (module docstring)."""
    lines = []
    for name, path in BUILTIN.items():
        try:
            environment_class(name)
        except Exception as exc:
            lines.append(f"{name}: unavailable here ({type(exc).__name__}: {exc}) [{path}]")
            continue
        if name not in FAMILIES:
            lines.append(f"{name} [{path}]")
            continue
        what = FAMILIES[name][0]
        found = members(name, check)
        usable = [m.name for m in found if not m.unavailable]
        lines.append(f"{name}: {len(usable)} {what}" + (" (checked)" if check else "") + f" [{path}]")
        lines.append("  " + ", ".join(usable))
        for m in found:
            if m.unavailable:
                lines.append(f"  unavailable: {m.name}: {m.unavailable}")
    if not check:
        lines.append(
            "(palaestra envs --check builds every dataset and game and says why any cannot run here)"
        )
    return lines
