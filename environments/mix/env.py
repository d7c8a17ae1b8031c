"""`mix`: several environments as one, each task drawn from one of them by weight.

    env:
      name: mix
      args:
        environments:
          math: {weight: 2, args: {difficulty: 1}}
          reasoning-gym: {args: {datasets: [chain_sum, spell_backward]}}
          textarena: {args: {games: [FrozenLake-v0]}}

Each entry is an environment name (a built-in or ``package.module:Class``) with its ``weight``
(default 1) and constructor ``args``, all built when the run's config is checked. Task ``i`` of
``tasks(seed)`` draws its environment by weight from a generator seeded with (seed, i) and takes
that environment's next task of ``tasks(seed)``; its id is ``<name>/<task_id>`` and its ``kind``
the environment's name, so evaluations report accuracy per family (``eval/accuracy/<name>``) and
training the reward per family (``rollout/reward_mean/<name>``). Episodes are the member's own
(its rollout, or its seats for a game of several players).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.sdk.environment import Environment, check_task
from palaestra.sdk.session import Session

__all__ = ["MixEnv", "MixTask"]


@dataclass(frozen=True)
class MixTask:
    task_id: str
    """``<environment>/<its task_id>``."""
    kind: str
    """The environment's name: accuracy and reward are reported per family."""
    task: Any
    """The member environment's own task."""


class MixEnv(Environment):
    name = "mix"

    def __init__(self, environments: Mapping[str, Any]):
        """`environments`: {name: {weight: w, args: {...}}} (module docstring)."""
        from palaestra.sdk.registry import load_environment

        if not isinstance(environments, Mapping) or not environments:
            raise ValueError("environments: a mapping of environment name to {weight, args}, at least one")
        self.members: list[tuple[str, float, Environment]] = []
        for name, options in environments.items():
            options = dict(options or {})
            unknown = sorted(set(options) - {"weight", "args"})
            if unknown:
                raise ValueError(
                    f"environments.{name}: unknown keys {unknown}; each takes 'weight' and 'args'"
                )
            weight = float(options.get("weight", 1.0))
            if weight <= 0:
                raise ValueError(f"environments.{name}.weight: must be positive; got {weight}")
            if name == self.name:
                raise ValueError("environments: a mix cannot hold another mix")
            try:
                env = load_environment(name, **dict(options.get("args") or {}))
            except Exception as exc:
                raise ValueError(f"environments.{name}: {type(exc).__name__}: {exc}") from exc
            self.members.append((name, weight, env))

    def tasks(self, seed: int) -> Iterator[MixTask]:
        streams = [iter(env.tasks(seed)) for _, _, env in self.members]
        weights = [w for _, w, _ in self.members]
        index = 0
        while streams:
            digest = hashlib.sha256(f"mix/{seed}/{index}".encode()).digest()
            k = random.Random(digest).choices(range(len(self.members)), weights)[0]
            index += 1
            name, _, env = self.members[k]
            try:
                task = next(streams[k])
            except StopIteration:  # a finite member starts its list again
                streams[k] = iter(env.tasks(seed))
                task = next(streams[k])
            yield MixTask(f"{name}/{check_task(env, task)}", name, task)

    def _member(self, task: MixTask) -> Environment:
        return next(env for name, _, env in self.members if name == task.kind)

    def seats(self, task: MixTask) -> int:
        return self._member(task).seats(task.task)

    async def rollout(self, session: Session, task: MixTask) -> Any:
        return await self._member(task).rollout(session, task.task)

    async def play(self, sessions: list[Session], task: MixTask) -> list[Any]:
        return await self._member(task).play(sessions, task.task)
