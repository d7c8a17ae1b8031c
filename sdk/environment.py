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

`self.model` is the model name sent to the gateway: `Environment.model`, "policy" (the gateway
serves one policy, whatever the name). The base class owns everything else: sessions, groups,
concurrency, retries, failure capture (`palaestra.sdk.runner`). `rollout` returns a float, or
`Reward(value, metrics)`, or a dict `{"reward": float, "metrics": {...}}`.

**The task contract.** `tasks(seed)` yields any objects; the runner hands each one to `rollout`
unchanged and reads only these attributes of it:

* `task_id` (required): a non-empty str (or an int), unique among the environment's tasks. It names
  the task's group (`env/task_id/run`) and is recorded as every sample's `task_id`.
* `kind` (optional): a str such as ``"arithmetic"``; held-out evaluation reports accuracy per kind
  when the tasks have several.

`Task(task_id, data)` below is a ready-made task; a frozen dataclass of your own fields (with a
`task_id`) is as good. A dict is not a task (wrap it: ``Task(task_id=d["id"], data=d)``).
`check_task` enforces this at the first task of every run (`run_rollouts`, and `palaestra train`'s
environment runner), with an error naming the environment, the task's type and the fix.
`tasks(seed)` must be reproducible: the same tasks in the same order for the same seed.

**Several seats.** An episode is one session unless `seats(task)` says more: then the runner opens
that many sessions of the task's group (seat i's with metadata ``{"seat": i}``) and calls
`play(sessions, task)` instead of `rollout`, which returns one reward per seat, each posted to its
own seat's session (a two-player game in self-play: both seats are the policy, and each seat's
samples are trained on with its own reward). If `play` raises, every seat's session closes as failed.
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


class TaskError(TypeError):
    """A task that breaks the task contract (see this module's docstring); the message says what to do."""


def check_task(env: Environment | Any, task: Any) -> str:
    """`task`'s id as a str, or TaskError naming the environment, the task's type, what is missing
    and how to fix it. The runner calls it on every task before its first session."""
    name = getattr(env, "name", type(env).__name__)
    where = f"environment {name!r} ({type(env).__module__}.{type(env).__qualname__}).tasks()"
    kind = type(task).__qualname__
    if not hasattr(task, "task_id"):
        hint = (
            f" (a dict with keys {sorted(map(str, task))[:8]}: wrap it as "
            "Task(task_id=..., data=the_dict) from palaestra.sdk)"
            if isinstance(task, dict)
            else ""
        )
        raise TaskError(
            f"{where} yielded a {kind} without a 'task_id' attribute{hint}. Every task needs a "
            "task_id (a non-empty str, unique among the tasks): yield palaestra.sdk.Task(task_id=..., "
            "data={...}) or an object of your own with a task_id field (docs/environments.md, "
            "'The task contract')"
        )
    task_id = task.task_id
    if isinstance(task_id, bool) or not isinstance(task_id, str | int) or task_id == "":
        raise TaskError(
            f"{where} yielded a {kind} whose task_id is {task_id!r} ({type(task_id).__name__}); "
            "a task_id must be a non-empty str (or an int), unique among the tasks"
        )
    return str(task_id)


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
    """Recorded as every sample's `env` and the first part of its group id."""
    model: str = "policy"
    """The model name to send to the gateway: it serves the one policy under any name."""

    @abstractmethod
    def tasks(self, seed: int) -> Iterable[Any]:
        """Tasks in a reproducible order for `seed`, each with a `task_id` (the task contract in
        this module's docstring). May be infinite."""

    @abstractmethod
    async def rollout(self, session: Session, task: Any) -> float | Reward | dict[str, Any]:
        """One episode: talk to the model through `session.client`, return the reward."""

    def kinds(self) -> list[str] | None:
        """The task kinds this environment's tasks are drawn over (datasets, games, task kinds),
        as their `kind` attribute spells them; held-out evaluation is stratified over them
        (`runner.stratified_tasks`). None (the default): the tasks are taken as they come."""
        return None

    def seats(self, task: Any) -> int:
        """Sessions one episode of `task` plays (module docstring, 'Several seats'); 1 by default."""
        return 1

    async def play(self, sessions: list[Session], task: Any) -> list[float | Reward | dict[str, Any]]:
        """One episode over `seats(task)` sessions of one group: one reward per seat, in seat order."""
        raise NotImplementedError(
            f"{type(self).__qualname__}.seats() is more than 1 for task {getattr(task, 'task_id', task)!r}, "
            "so the environment must implement play(sessions, task)"
        )
