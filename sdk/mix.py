"""`WeightedMix`: named entries with weights, read from an environment's arguments, and a seeded
draw among them: reasoning-gym's datasets, TextArena's games and the mix environment's members.

    mix = WeightedMix.parse({"chain_sum": {"weight": 3}, "maze": {}}, DatasetOptions,
                            key="datasets", what="dataset", example="['chain_sum']", salt="reasoning-gym")
    for draw in mix.draws(seed):        # task i: draw.entry, drawn by weight from (salt, seed, i)
        ...

An argument is one name, a list of names (equal weights, every option its default) or a mapping of
name to options: ``weight`` (a positive number, default 1) and the fields of the entry's options
dataclass, read by `read_options` (sdk/options.py), so every error is one line naming the key
(``datasets.maze.weight: must be a positive number; got -1``).

Draw ``i`` of ``draws(seed)`` picks its entry with ``random.Random(sha256("<salt>/<seed>/<i>"))``
by weight, and hands on that generator (`Draw.rng`) for whatever else the task draws (TextArena's
game seed), so a stream depends only on the salt, the seed and the entries with their weights.
"""

from __future__ import annotations

import hashlib
import random
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, NamedTuple, TypeVar

from palaestra.sdk.options import read_options

__all__ = ["Draw", "Entry", "WeightedMix"]

T = TypeVar("T")
U = TypeVar("U")


def _placeholder(hint: Any) -> str:
    """How an entry's shape shows a field in an error: ``name: {weight: w, config: {...}}``."""
    kind = typing.get_origin(hint) or hint
    return "{...}" if kind is dict else "[...]" if kind is list else "..."


class Entry(NamedTuple, Generic[T]):
    """One named entry: its weight and its options (or what was built from them, `WeightedMix.map`)."""

    name: str
    weight: float
    value: T


@dataclass(frozen=True)
class Draw(Generic[T]):
    """Draw ``index`` of a stream: the entry drawn and the generator that drew it."""

    index: int
    position: int
    """The entry's place in the mix (names may repeat in a list)."""
    entry: Entry[T]
    rng: random.Random
    """Seeded by (salt, seed, index), already used once to draw the entry."""


@dataclass(frozen=True)
class WeightedMix(Generic[T]):
    """Entries with positive weights and the salt of their seeded draw (module docstring)."""

    entries: tuple[Entry[T], ...]
    salt: str

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a WeightedMix needs at least one entry")
        bad = [e for e in self.entries if not e.weight > 0]
        if bad:
            raise ValueError(f"weights must be positive; got {bad[0].name}: {bad[0].weight!r}")

    @classmethod
    def parse(
        cls,
        raw: str | Sequence[str] | Mapping[str, Any],
        options: type[T],
        *,
        key: str,
        what: str,
        example: str,
        salt: str,
        error: type[ValueError] = ValueError,
    ) -> WeightedMix[T]:
        """The mix an argument names (module docstring): `options` the dataclass of an entry's other
        keys; `key` the argument's name and `what` an entry (for the errors, e.g. "datasets",
        "dataset", "['chain_sum']"); `error` the environment's own `ValueError` class."""
        if isinstance(raw, str):
            raw = [raw]
        if isinstance(raw, Mapping):
            items = list(raw.items())
        elif isinstance(raw, Sequence):
            items = [(name, None) for name in raw]
        else:
            raise error(f"{key}: a list of {what} names or a mapping of name to options; got {raw!r}")
        if not items:
            raise error(f"{key}: name at least one {what} (e.g. {example})")
        takes = ["weight", *(f.name for f in fields(options))]  # type: ignore[arg-type]
        hints = typing.get_type_hints(options)
        shape = ", ".join(["weight: w", *(f"{name}: {_placeholder(hints[name])}" for name in takes[1:])])
        entries = []
        for name, given in items:
            given = {} if given is None else given
            if not isinstance(name, str) or not isinstance(given, Mapping):
                raise error(f"{key}: each entry is a name or name: {{{shape}}}; got {name!r}: {given!r}")
            unknown = sorted(set(given) - set(takes), key=str)
            if unknown:
                raise error(
                    f"{key}.{name}: unknown keys {unknown}; each takes {' and '.join(map(repr, takes))}"
                )
            weight = given.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
                raise error(f"{key}.{name}.weight: must be a positive number; got {weight!r}")
            rest = {k: v for k, v in given.items() if k != "weight"}
            entries.append(
                Entry(name, float(weight), read_options(options, rest, path=f"{key}.{name}", error=error))
            )
        return cls(tuple(entries), salt)

    def map(self, build: Callable[[Entry[T]], U]) -> WeightedMix[U]:
        """The same names, weights and draws, each entry's value `build(entry)`."""
        return WeightedMix(tuple(Entry(e.name, e.weight, build(e)) for e in self.entries), self.salt)

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, position: int) -> Entry[T]:
        return self.entries[position]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def draw(self, seed: int, index: int) -> Draw[T]:
        """Draw `index` of `draws(seed)`."""
        rng = random.Random(hashlib.sha256(f"{self.salt}/{seed}/{index}".encode()).digest())
        position = rng.choices(range(len(self.entries)), [e.weight for e in self.entries])[0]
        return Draw(index, position, self.entries[position], rng)

    def draws(self, seed: int) -> Iterator[Draw[T]]:
        """Draws 0, 1, 2, ... for `seed`: the same sequence for the same seed, salt and entries."""
        index = 0
        while True:
            yield self.draw(seed, index)
            index += 1
