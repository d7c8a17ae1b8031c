"""Typed environment options: a frozen dataclass read from the mapping a run's ``env.args`` holds,
every check in one place and every error one line naming the key.

    @dataclass(frozen=True)
    class GameOptions:
        players: int | None = None
        \"\"\"Players the game is played with (None: the fewest it accepts).\"\"\"

    read_options(GameOptions, {"players": 2}, path="games.TicTacToe-v0")     # GameOptions(players=2)
    read_options(GameOptions, {"players": "2"}, path="games.TicTacToe-v0")
    # ValueError: games.TicTacToe-v0.players: must be an integer or None; got '2'

`read_options` checks the keys (the dataclass's fields), each value against its field's type
(int, float, str, bool, dict, list, None, a class; ``X | None``), then builds the dataclass; a
check of several fields (a range, a choice) lives in its ``__post_init__`` and raises `OptionError`
naming the field, which `read_options` prefixes with the path. An environment's constructor keeps
its keyword arguments (``env.args`` is checked against them when a run's config loads) and reads
them into its options dataclass.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["OptionError", "read_options"]

T = TypeVar("T")


class OptionError(ValueError):
    """An option that is not allowed: `key` the field (or dotted path), the message one line."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a mapping",
    list: "a list",
}


def _accepts(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts(value, arm) for arm in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    kind = origin or hint
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    if kind is dict:
        return isinstance(value, Mapping)
    if kind is list:
        return isinstance(value, list | tuple)
    return not isinstance(kind, type) or isinstance(value, kind)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    if hint is None or hint is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    kind = origin or hint
    return _KINDS.get(kind, getattr(kind, "__name__", str(kind)))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_options(
    cls: type[T], raw: Mapping[str, Any] | None, *, path: str = "", error: type[ValueError] = ValueError
) -> T:
    """An instance of the options dataclass `cls` from `raw` (None: every default); `error` (a
    `ValueError` class, the environment's own) naming ``<path>.<field>`` for an unknown key, a value
    of the wrong type or one its ``__post_init__`` refuses."""
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    names = [f.name for f in fields]
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise error(f"{path or cls.__name__}: must be a mapping of {', '.join(names)}; got {raw!r}")
    unknown = sorted(set(raw) - set(names), key=str)
    if unknown:
        takes = " and ".join(map(repr, names)) if names else "no keys"
        raise error(f"{path or cls.__name__}: unknown keys {unknown}; each takes {takes}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields:
        if f.name not in raw:
            continue
        value = raw[f.name]
        if value is None and typing.get_origin(hints[f.name]) is dict:
            continue  # ``config:`` left empty in YAML: the default mapping
        if not _accepts(value, hints[f.name]):
            raise error(f"{_join(path, f.name)}: must be {_describe(hints[f.name])}; got {value!r}")
        values[f.name] = dict(value) if isinstance(value, Mapping) else value
    try:
        return cls(**values)
    except OptionError as exc:
        raise error(f"{_join(path, exc.key)}: {exc.problem}") from None
