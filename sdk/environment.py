"""`Environment`: a task source and one async rollout written with the `openai` SDK.

A complete environment:

    class Echo(Environment):
        name = "echo"

        def tasks(self, seed):                      # finite list or infinite iterator
            return [Task(task_id=str(i), data={"word": w}) for i, w in enumerate(["a", "b"])]

        async def rollout(self, session, task):     # talks to the model only via session.client
            r = await session.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": f"Say {task.data['word']}"}],
                **session.sampling)                  # the run's temperature, the episode's seed
            return float(task.data["word"] in (r.choices[0].message.content or ""))

The base class owns everything else: sessions, groups, concurrency, retries, failure capture
(`palaestra.sdk.runner`). `rollout` returns a float, or `Reward(value, metrics)`, or a dict
`{"reward": float, "metrics": {...}}`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from palaestra.sdk.session import Session


@dataclass(frozen=True)
class Task:
    """A generic task: an id and whatever the environment needs."""

    task_id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reward:
    value: float
    metrics: dict[str, float] = field(default_factory=dict)


def as_reward(result: Any) -> Reward:
    """Normalises what `rollout` returned."""
    if isinstance(result, Reward):
        return result
    if isinstance(result, bool) or not isinstance(result, (int, float, dict)):
        raise TypeError(f"rollout must return a float, a Reward or a dict with 'reward'; got {result!r}")
    if isinstance(result, dict):
        if "reward" not in result:
            raise TypeError(f"a dict returned by rollout needs a 'reward' key; got keys {sorted(result)}")
        metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items()}
        return Reward(float(result["reward"]), metrics)
    return Reward(float(result))


class Environment(ABC):
    """Subclass with `name`, `tasks(seed)` and `async rollout(session, task)`."""

    name: str = "env"
    model: str = "policy"  # the model name sent to the gateway (it serves one policy)

    @abstractmethod
    def tasks(self, seed: int) -> Iterable[Any]:
        """Tasks in a reproducible order for `seed`; each has a `task_id`. May be infinite."""

    @abstractmethod
    async def rollout(self, session: Session, task: Any) -> float | Reward | dict[str, Any]:
        """One episode: talk to the model through `session.client`, return the reward."""
