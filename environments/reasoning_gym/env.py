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
(``palaestra train``'s evaluation seed, ``palaestra eval --seed``) reads other items. Each task's
``kind`` is its dataset, so evaluations report accuracy per dataset (``eval/accuracy/<dataset>``)
when there are several.

One turn: the dataset's question under reasoning-gym's own system prompt (answer inside
``<answer>...</answer>``); the reward is ``score_answer(extracted, entry)`` (0-1; some datasets
give partial credit), with metrics ``correct`` (reward 1), ``answered`` (an answer tag was found).

The constructor builds every dataset (and its first item), so an unknown name (the error lists
the 106 that exist), a config field the dataset does not take, or a dataset that fails to build
is reported when a run's config is checked, naming the dataset and its error.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

__all__ = ["DatasetError", "ReasoningGymEnv", "RGTask", "dataset_names"]


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
class _Spec:
    name: str
    weight: float
    config: dict[str, Any]


def _specs(datasets: Sequence[str] | Mapping[str, Any]) -> list[_Spec]:
    if isinstance(datasets, str):
        datasets = [datasets]
    if isinstance(datasets, Mapping):
        items = list(datasets.items())
    else:
        items = [(name, {}) for name in datasets]
    if not items:
        raise DatasetError("datasets: name at least one dataset (e.g. ['chain_sum'])")
    specs = []
    for name, options in items:
        options = options or {}
        if not isinstance(name, str) or not isinstance(options, Mapping):
            raise DatasetError(
                f"datasets: each entry is a name or name: {{weight: w, config: {{...}}}}; got {name!r}: {options!r}"
            )
        unknown = sorted(set(options) - {"weight", "config"})
        if unknown:
            raise DatasetError(f"datasets.{name}: unknown keys {unknown}; each takes 'weight' and 'config'")
        weight = options.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise DatasetError(f"datasets.{name}.weight: must be a positive number; got {weight!r}")
        config = options.get("config") or {}
        if not isinstance(config, Mapping):
            raise DatasetError(f"datasets.{name}.config: must be a mapping of the dataset's config fields")
        specs.append(_Spec(name, float(weight), dict(config)))
    return specs


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
        """`datasets` a list of names or {name: {weight, config}} (module docstring); `size` items
        per dataset and seed (the task stream wraps after them); `system_prompt` one of
        reasoning-gym's prompts (default, simple, direct, DeepSeekZero, chain_of_draft)."""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"system_prompt: one of {', '.join(SYSTEM_PROMPTS)}; got {system_prompt!r}")
        if size < 1:
            raise ValueError(f"size: must be >= 1; got {size}")
        self.specs = _specs(datasets)
        self.size, self.max_tokens = size, max_tokens
        self.system = SYSTEM_PROMPTS[system_prompt]
        self._datasets: dict[tuple[str, int], Any] = {}
        for spec in self.specs:  # every dataset builds, and yields its first item, now
            dataset = self._dataset(spec, 0)
            try:
                dataset[0]
            except Exception as exc:
                raise DatasetError(
                    f"reasoning-gym dataset {spec.name!r} built but failed to generate a task: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

    def _dataset(self, spec: _Spec, seed: int) -> Any:
        key = (spec.name, seed)
        if key not in self._datasets:
            self._datasets[key] = build_dataset(spec.name, spec.config, seed, self.size)
        return self._datasets[key]

    def tasks(self, seed: int) -> Iterator[RGTask]:
        weights = [s.weight for s in self.specs]
        taken = dict.fromkeys(range(len(self.specs)), 0)
        index = 0
        while True:
            digest = hashlib.sha256(f"reasoning-gym/{seed}/{index}".encode()).digest()
            k = random.Random(digest).choices(range(len(self.specs)), weights)[0]
            spec, item = self.specs[k], taken[k] % self.size
            taken[k] += 1
            index += 1
            entry = self._dataset(spec, seed)[item]
            yield RGTask(f"{spec.name}-s{seed}-{item}", spec.name, entry["question"], seed, entry)

    def score(self, task: RGTask, reply: str) -> Reward:
        """The reward of `reply` (the model's text): its ``<answer>`` scored by the dataset."""
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(reply)
        dataset = self._datasets[(task.kind, task.seed)]
        value = float(dataset.score_answer(answer, task.entry)) if answer is not None else 0.0
        return Reward(value, {"correct": float(value >= 1.0), "answered": float(answer is not None)})

    async def rollout(self, session: Session, task: RGTask) -> Reward:
        reply = await session.client.chat.completions.create(
            model=self.model,
            max_tokens=self.max_tokens,
            messages=[{"role": "system", "content": self.system}, {"role": "user", "content": task.question}],
            **session.sampling,
        )
        return self.score(task, reply.choices[0].message.content or "")
