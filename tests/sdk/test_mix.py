"""`WeightedMix` (sdk/mix.py) and `read_options` (sdk/options.py): the three shapes of an argument,
one-line errors naming the key, and a seeded draw that is the same for the same seed."""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from palaestra.sdk.mix import Entry, WeightedMix
from palaestra.sdk.options import OptionError, read_options


@dataclass(frozen=True)
class Options:
    config: dict[str, Any] = field(default_factory=dict)
    players: int | None = None


@dataclass(frozen=True)
class Ranged:
    size: int = 10
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise OptionError("size", f"must be >= 1; got {self.size}")


class EnvError(ValueError):
    pass


def parse(raw: Any) -> WeightedMix[Options]:
    return WeightedMix.parse(
        raw, Options, key="things", what="thing", example="['a']", salt="test", error=EnvError
    )


def test_a_name_a_list_and_a_mapping_are_one_mix():
    assert list(parse("a")) == [Entry("a", 1.0, Options())]
    assert parse(["a", "b"]).names == ["a", "b"] and [e.weight for e in parse(["a", "b"])] == [1.0, 1.0]
    mix = parse({"a": {"weight": 3, "config": {"k": 1}}, "b": None, "c": {"players": 2, "config": None}})
    assert list(mix) == [
        Entry("a", 3.0, Options(config={"k": 1})),
        Entry("b", 1.0, Options()),
        Entry("c", 1.0, Options(players=2)),
    ]
    name, weight, value = mix[0]  # an entry unpacks as (name, weight, value)
    assert (name, weight, value.config) == ("a", 3.0, {"k": 1}) and len(mix) == 3


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "things: name at least one thing (e.g. ['a'])"),
        ({}, "things: name at least one thing (e.g. ['a'])"),
        (5, "things: a list of thing names or a mapping of name to options; got 5"),
        (
            {"a": [1]},
            "things: each entry is a name or name: {weight: w, config: {...}, players: ...}; got 'a': [1]",
        ),
        ([7], "things: each entry is a name or name: {weight: w, config: {...}, players: ...}; got 7: {}"),
        (
            {"a": {"wieght": 2}},
            "things.a: unknown keys ['wieght']; each takes 'weight' and 'config' and 'players'",
        ),
        ({"a": {"weight": 0}}, "things.a.weight: must be a positive number; got 0"),
        ({"a": {"weight": -1.5}}, "things.a.weight: must be a positive number; got -1.5"),
        ({"a": {"weight": True}}, "things.a.weight: must be a positive number; got True"),
        ({"a": {"weight": "2"}}, "things.a.weight: must be a positive number; got '2'"),
        ({"a": {"config": [1]}}, "things.a.config: must be a mapping; got [1]"),
        ({"a": {"players": "2"}}, "things.a.players: must be an integer or None; got '2'"),
        ({"a": {"players": 2.0}}, "things.a.players: must be an integer or None; got 2.0"),
    ],
)
def test_a_bad_argument_is_one_line_naming_its_key(raw, message):
    with pytest.raises(EnvError) as err:
        parse(raw)
    assert str(err.value) == message and "\n" not in str(err.value)


def test_draws_are_seeded_by_salt_seed_and_index():
    mix = parse({"a": {"weight": 3}, "b": {}})
    first = [d.entry.name for d in itertools.islice(mix.draws(0), 200)]
    assert first == [d.entry.name for d in itertools.islice(mix.draws(0), 200)]
    assert first != [d.entry.name for d in itertools.islice(mix.draws(1), 200)]
    assert 120 < first.count("a") < 180  # weight 3 of 4
    # draw i is sha256("<salt>/<seed>/<i>")'s generator's weighted choice; its rng goes on from there
    for draw in itertools.islice(mix.draws(5), 20):
        rng = random.Random(hashlib.sha256(f"test/5/{draw.index}".encode()).digest())
        assert draw.position == rng.choices(range(2), [3.0, 1.0])[0] and draw.entry is mix[draw.position]
        assert draw.rng.random() == rng.random()
    salted = WeightedMix(mix.entries, "other")
    assert first != [d.entry.name for d in itertools.islice(salted.draws(0), 200)]


def test_map_keeps_names_weights_and_draws():
    mix = parse({"a": {"weight": 2, "players": 4}, "b": {}})
    built = mix.map(lambda entry: f"built {entry.name} for {entry.value.players}")
    assert list(built) == [Entry("a", 2.0, "built a for 4"), Entry("b", 1.0, "built b for None")]
    assert [d.position for d in itertools.islice(built.draws(3), 50)] == [
        d.position for d in itertools.islice(mix.draws(3), 50)
    ]


def test_a_mix_refuses_no_entries_and_weights_that_are_not_positive():
    with pytest.raises(ValueError, match="at least one entry"):
        WeightedMix((), "s")
    with pytest.raises(ValueError, match="weights must be positive; got a: 0.0"):
        WeightedMix((Entry("a", 0.0, None),), "s")


def test_read_options_checks_keys_types_and_post_init_naming_the_path():
    assert read_options(Ranged, None) == Ranged() and read_options(Ranged, {"size": 3}) == Ranged(size=3)
    assert read_options(Ranged, {"temperature": 1}).temperature == 1  # an int is a number
    cases = [
        ({"size": 0}, "env.size: must be >= 1; got 0"),
        ({"size": True}, "env.size: must be an integer; got True"),
        ({"temperature": "hot"}, "env.temperature: must be a number or None; got 'hot'"),
        ({"sise": 3}, "env: unknown keys ['sise']; each takes 'size' and 'temperature'"),
        ([1], "env: must be a mapping of size, temperature; got [1]"),
    ]
    for raw, message in cases:
        with pytest.raises(EnvError) as err:
            read_options(Ranged, raw, path="env", error=EnvError)
        assert str(err.value) == message
    with pytest.raises(ValueError, match="^size: must be >= 1; got 0$"):
        read_options(Ranged, {"size": 0})
