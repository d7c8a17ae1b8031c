"""`reasoning-gym`: the procedural datasets of the `reasoning-gym` library (PyPI `reasoning-gym`,
`pip install -e .[reasoning-gym]`; `make install` installs it), each task scored by its own
dataset's `score_answer`.

    palaestra eval --env reasoning-gym --gateway $GW --tasks 50 \\
        --env-args '{"datasets": {"spell_backward": {}, "countdown": {"weight": 2, "config": {"min_numbers": 3}}}}'

`datasets` names the datasets: a list (``["chain_sum", "maze"]``, equal weights) or a mapping of
name to ``{"weight": w, "config": {...}}`` (the dataset's own config fields, e.g. countdown's
``min_numbers``). Task ``i`` of ``tasks(seed)`` draws its dataset by weight from a generator
seeded with (seed, i), then takes that dataset's next item of ``create_dataset(name, seed=seed,
size=size, **config)``, so ``tasks(seed)`` is reproducible and the held-out evaluation
(``palaestra train``'s evaluation seed, ``palaestra eval --seed``) reads other items. The items
of three datasets depend on PYTHONHASHSEED; they are generated in a child process with a fixed one,
so the tasks are the same in every process (`HASH_SEEDED`). Each task's
``kind`` is its dataset, so evaluations report accuracy per dataset (``eval/accuracy/<dataset>``)
when there are several.

One turn: the dataset's question under reasoning-gym's own system prompt (answer inside
``<answer>...</answer>``); the reward is ``score_answer(extracted, entry)`` (0-1; some datasets
give partial credit), with metrics ``correct`` (reward 1), ``answered`` (an answer tag was found),
``failure/unparseable_answer`` (the dataset's scorer raised on the answer, e.g. prime_factorization
on a non-numeric one: scored 0, so the policy is penalised for it, not dropped as a failed episode).

The constructor builds every dataset (and its first item), so an unknown name (the error lists
the 106 that exist), a config field the dataset does not take, or a dataset that fails to build
is reported when a run's config is checked, naming the dataset and its error.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.mix import Entry, WeightedMix
from palaestra.sdk.options import OptionError, read_options
from palaestra.sdk.session import Session

# reasoning-gym imports cellpylib (game_of_life), whose 2.4.0 sources compare with `is` to
# literals: compiled without a cached .pyc (a fresh install), each such line printed a
# SyntaxWarning at every import. Only cellpylib's own files, only that category.
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]cellpylib[/\\]")

__all__ = [
    "DatasetError",
    "DatasetOptions",
    "ReasoningGymEnv",
    "ReasoningGymOptions",
    "RGTask",
    "dataset_names",
]


class DatasetError(ValueError):
    """A dataset that does not exist or could not be built; the message names it and what to change."""


def dataset_names() -> list[str]:
    """The datasets reasoning-gym registers (106 in 0.1.25)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@dataclass(frozen=True)
class RGTask:
    task_id: str
    """``<dataset>-s<seed>-<item>``: the dataset, the seed of its items and the item's index."""
    kind: str
    """The dataset's name: accuracy is reported per dataset."""
    question: str
    seed: int
    """The seed the dataset was built with (its items differ per seed)."""
    entry: Mapping[str, Any] = field(repr=False, compare=False)
    """The dataset's item (question, answer, metadata): what `score_answer` reads."""


@dataclass(frozen=True)
class DatasetOptions:
    """A dataset's entry in `datasets` besides its weight."""

    config: dict[str, Any] = field(default_factory=dict)
    """The dataset's own config fields (e.g. countdown's ``min_numbers``), passed to
    ``create_dataset``."""


@dataclass(frozen=True)
class ReasoningGymOptions:
    """`ReasoningGymEnv`'s arguments, checked (module docstring)."""

    datasets: WeightedMix[DatasetOptions]
    size: int = 10_000
    """Items per dataset and seed: the task stream wraps after them."""
    max_tokens: int = 512
    system_prompt: str = "default"
    """One of reasoning-gym's prompts (default, simple, direct, DeepSeekZero, chain_of_draft)."""

    def __post_init__(self) -> None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if self.system_prompt not in SYSTEM_PROMPTS:
            raise OptionError(
                "system_prompt", f"one of {', '.join(SYSTEM_PROMPTS)}; got {self.system_prompt!r}"
            )
        if self.size < 1:
            raise OptionError("size", f"must be >= 1; got {self.size}")


HASH_SEEDED = frozenset({"isomorphic_strings", "polynomial_multiplication", "ransom_note"})
"""Datasets whose items depend on the process's PYTHONHASHSEED (they iterate over sets of
strings), so the same seed gives other tasks in another process: their items are generated in a
child process with PYTHONHASHSEED=0 (`FixedHashItems`). Found by building every dataset in two
processes with different hash seeds and comparing (tests/environments/test_reasoning_gym.py)."""

_ITEMS = """
import pickle, sys, warnings
warnings.simplefilter("ignore")
from palaestra.environments.reasoning_gym.env import build_dataset
name, config, seed, size, start, stop = pickle.load(sys.stdin.buffer)
dataset = build_dataset(name, config, seed, size)
pickle.dump([dataset[i] for i in range(start, stop)], sys.stdout.buffer)
"""


class FixedHashItems:
    """A `HASH_SEEDED` dataset's items as a process with PYTHONHASHSEED=0 generates them, fetched
    `chunk` at a time from a child process and kept; `score_answer` is the dataset's own."""

    def __init__(self, name: str, config: Mapping[str, Any], seed: int, size: int, chunk: int = 64):
        self.dataset = build_dataset(name, config, seed, size)
        self.args, self.size, self.chunk = (name, dict(config), seed, size), size, chunk
        self.items: dict[int, Any] = {}

    def score_answer(self, answer: Any, entry: Any) -> Any:
        return self.dataset.score_answer(answer, entry)

    def __getitem__(self, index: int) -> Any:
        if index not in self.items:
            import os
            import pickle
            import subprocess
            import sys

            start = index - index % self.chunk
            stop = min(start + self.chunk, self.size)
            done = subprocess.run(
                [sys.executable, "-c", _ITEMS],
                input=pickle.dumps((*self.args, start, stop)),
                capture_output=True,
                env={**os.environ, "PYTHONHASHSEED": "0"},
                check=False,
            )
            if done.returncode != 0:
                tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
                raise DatasetError(f"reasoning-gym dataset {self.args[0]!r}: generating items failed: {tail}")
            self.items.update(zip(range(start, stop), pickle.loads(done.stdout), strict=True))
        return self.items[index]


def build_dataset(name: str, config: Mapping[str, Any], seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset(name, seed=seed, size=size, **config)``, its failures as a
    `DatasetError` naming the dataset (and, for an unknown name, the ones that exist)."""
    import reasoning_gym

    names = dataset_names()
    if name not in names:
        raise DatasetError(f"unknown reasoning-gym dataset {name!r}; the datasets are: {', '.join(names)}")
    config = dict(config)
    if name == "composite" and "datasets" in config:  # its specs as plain mappings in YAML
        from reasoning_gym.composite import DatasetSpec

        config["datasets"] = [
            d if isinstance(d, DatasetSpec) else DatasetSpec(**d) for d in config["datasets"]
        ]
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except Exception as exc:  # the library's own errors: a bad field, a failed assertion
        raise DatasetError(
            f"reasoning-gym dataset {name!r} could not be built with config {dict(config)!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


class ReasoningGymEnv(Environment):
    name = "reasoning-gym"

    def __init__(
        self,
        datasets: Sequence[str] | Mapping[str, Any] = ("chain_sum",),
        size: int = 10_000,
        max_tokens: int = 512,
        system_prompt: str = "default",
    ):
        """`datasets` a list of names or {name: {weight, config}} (module docstring); the others
        are `ReasoningGymOptions`' fields."""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        mix = WeightedMix.parse(
            datasets,
            DatasetOptions,
            key="datasets",
            what="dataset",
            example="['chain_sum']",
            salt=self.name,
            error=DatasetError,
        )
        self.options = read_options(
            ReasoningGymOptions,
            {"datasets": mix, "size": size, "max_tokens": max_tokens, "system_prompt": system_prompt},
        )
        options = self.options
        self.datasets, self.size, self.max_tokens = options.datasets, options.size, options.max_tokens
        self.system = SYSTEM_PROMPTS[options.system_prompt]
        self._built: dict[tuple[str, int], Any] = {}
        for entry in self.datasets:  # every dataset builds, and yields its first item, now
            dataset = self._dataset(entry, 0)
            try:
                getattr(dataset, "dataset", dataset)[0]  # in this process, even a `FixedHashItems`'s
            except Exception as exc:
                raise DatasetError(
                    f"reasoning-gym dataset {entry.name!r} built but failed to generate a task: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

    def _dataset(self, entry: Entry[DatasetOptions], seed: int) -> Any:
        key = (entry.name, seed)
        if key not in self._built:
            fixed = entry.name in HASH_SEEDED and os.environ.get("PYTHONHASHSEED") != "0"
            build = FixedHashItems if fixed else build_dataset
            self._built[key] = build(entry.name, entry.value.config, seed, self.size)
        return self._built[key]

    def kinds(self) -> list[str]:
        return self.datasets.names

    def tasks(self, seed: int) -> Iterator[RGTask]:
        taken = [0] * len(self.datasets)
        for draw in self.datasets.draws(seed):
            item = taken[draw.position] % self.size
            taken[draw.position] += 1
            name, entry = draw.entry.name, self._dataset(draw.entry, seed)[item]
            yield RGTask(f"{name}-s{seed}-{item}", name, entry["question"], seed, entry)

    def score(self, task: RGTask, reply: str) -> Reward:
        """The reward of `reply` (the model's text): its ``<answer>`` scored by the dataset."""
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(reply)
        dataset = self._built[(task.kind, task.seed)]
        unparseable = False
        try:
            value = float(dataset.score_answer(answer, task.entry)) if answer is not None else 0.0
        except Exception:  # e.g. prime_factorization's int() of a non-numeric answer: a wrong
            # answer scored 0 and counted, not a failed episode (which would never be trained on)
            value, unparseable = 0.0, True
        return Reward(
            value,
            {
                "correct": float(value >= 1.0),
                "answered": float(answer is not None),
                "failure/unparseable_answer": float(unparseable),
            },
        )

    async def rollout(self, session: Session, task: RGTask) -> Reward:
        reply = await session.client.chat.completions.create(
            model=self.model,
            max_tokens=self.max_tokens,
            messages=[{"role": "system", "content": self.system}, {"role": "user", "content": task.question}],
            **session.sampling,
        )
        return self.score(task, reply.choices[0].message.content or "")
