"""`mix`: several environments as one, each task drawn from one of them by weight.

    env:
      name: mix
      args:
        environments:
          math: {weight: 2, args: {difficulty: 1}}
          reasoning-gym: {args: {datasets: [chain_sum, spell_backward]}}
          textarena: {args: {games: [FrozenLake-v0]}}

Each entry is an environment name (a built-in or ``package.module:Class``) with its ``weight``
(default 1) and constructor ``args`` (`MemberOptions`; a list of names gives each weight 1 and its
default arguments), all built when the run's config is checked (`palaestra.sdk.mix.WeightedMix`). Task ``i`` of
``tasks(seed)`` draws its environment by weight from a generator seeded with (seed, i) and takes
that environment's next task of ``tasks(seed)``; its id is ``<name>/<task_id>`` and its ``kind``
the environment's name, so evaluations report accuracy per family (``eval/accuracy/<name>``) and
training the reward per family (``rollout/reward_mean/<name>``). Episodes are the member's own
(its rollout, or its seats for a game of several players).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.sdk.environment import Environment, check_task
from palaestra.sdk.mix import Entry, WeightedMix
from palaestra.sdk.session import Session

__all__ = ["MemberOptions", "MixEnv", "MixTask"]


@dataclass(frozen=True)
class MixTask:
    task_id: str
    """``<environment>/<its task_id>``."""
    kind: str
    """The environment's name: accuracy and reward are reported per family."""
    task: Any
    """The member environment's own task."""


@dataclass(frozen=True)
class MemberOptions:
    """A member's entry in `environments` besides its weight."""

    args: dict[str, Any] = field(default_factory=dict)
    """The member's constructor arguments (its ``env.args``)."""


class MixEnv(Environment):
    name = "mix"

    def __init__(self, environments: Mapping[str, Any] | Sequence[str]):
        """`environments`: {name: {weight: w, args: {...}}}, or a list of names (module docstring)."""
        mix = WeightedMix.parse(
            environments,
            MemberOptions,
            key="environments",
            what="environment",
            example="{math: {weight: 2}, reasoning-gym: {}}",
            salt=self.name,
        )
        if self.name in mix.names:
            raise ValueError("environments: a mix cannot hold another mix")
        self.members: WeightedMix[Environment] = mix.map(self._build)

    @staticmethod
    def _build(entry: Entry[MemberOptions]) -> Environment:
        from palaestra.sdk.registry import load_environment

        try:
            return load_environment(entry.name, **entry.value.args)
        except Exception as exc:
            raise ValueError(f"environments.{entry.name}: {type(exc).__name__}: {exc}") from exc

    def kinds(self) -> list[str]:
        return self.members.names

    def tasks(self, seed: int) -> Iterator[MixTask]:
        streams = [iter(env.tasks(seed)) for _, _, env in self.members]
        for draw in self.members.draws(seed):
            name, _, env = draw.entry
            try:
                task = next(streams[draw.position])
            except StopIteration:  # a finite member starts its list again
                streams[draw.position] = iter(env.tasks(seed))
                task = next(streams[draw.position])
            yield MixTask(f"{name}/{check_task(env, task)}", name, task)

    def _member(self, task: MixTask) -> Environment:
        return next(env for name, _, env in self.members if name == task.kind)

    def seats(self, task: MixTask) -> int:
        return self._member(task).seats(task.task)

    async def rollout(self, session: Session, task: MixTask) -> Any:
        return await self._member(task).rollout(session, task.task)

    async def play(self, sessions: list[Session], task: MixTask) -> list[Any]:
        return await self._member(task).play(sessions, task.task)
