"""The harbor environment: Harbor task directories, attempted by an agent in our sandbox, graded
by the task's own tests/test.sh.

    palaestra eval --env harbor --tasks 12 --env-args '{"agent": "claude-code", "backend": "local"}'
    palaestra train ... env.name=harbor env.args.path=my-tasks env.args.agent=openai-tools

One episode: the task's environment built offline once (`build.py`), a fresh sandbox with a copy
of it (`trial.py`), the agent's attempt (`agents.py`: a harness, ``openai-tools``, ``oracle``,
``none``), then test.sh as the verifier. The reward is the verifier's primary reward; every named
reward is a metric ``reward/<name>``. A verifier that cannot grade raises (`GraderFailure`): the
episode is counted failed and never trained on, not scored 0; so is a sandbox that fails under
the episode (``failure/sandbox_error``, environments/episode.py).

Tasks (``path``: a directory of task directories, or one; default the bundled examples) are every
task once, in a seeded order; ``tasks`` (a list of task names, or ``{name: {weight: w}}``) draws
among the named ones by weight instead, without end (sdk/mix.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.environments.episode import EpisodeLog, resolve_backend, sandbox_failed
from palaestra.environments.harbor.agents import AgentOptions, make_agent
from palaestra.environments.harbor.build import build_environment
from palaestra.environments.harbor.task import HarborTask, TaskError, load_tasks
from palaestra.environments.harbor.trial import Trial
from palaestra.sandbox.base import SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.mix import WeightedMix
from palaestra.sdk.session import Session

__all__ = ["EXAMPLES", "HarborEnv", "TaskOptions"]

EXAMPLES = Path(__file__).with_name("examples")


@dataclass(frozen=True)
class TaskOptions:
    """A task entry of ``tasks`` takes only a weight."""


@dataclass(frozen=True)
class Episode:
    task_id: str
    task: HarborTask

    @property
    def kind(self) -> str | None:
        """``[metadata].category`` (eval scores each kind apart when there are several)."""
        category = self.task.metadata.get("category")
        return category if isinstance(category, str) else None


class HarborEnv(Environment):
    name = "harbor"

    def __init__(
        self,
        path: str | None = None,
        agent: str = "openai-tools",
        backend: Any = "local",
        tasks: Sequence[str] | Mapping[str, Any] | None = None,
        max_turns: int = 20,
        max_tokens: int = 1024,
        tool_timeout_s: float = 60.0,
        internet: str = "isolate",
        reward_key: str | None = None,
        max_output_tokens: int | None = None,
    ):
        """`path` a directory of Harbor tasks or one task (default: environments/harbor/examples);
        `agent` a harness name (``palaestra harness install`` it), ``openai-tools``, ``oracle`` or
        ``none`` (agents.py); `backend` a sandbox spec (local, docker) or a `Backend`; `tasks` the
        names to draw from, optionally weighted (default: every task once); `max_turns`,
        `max_tokens`, `tool_timeout_s` the agent's budgets (`AgentOptions`); `internet` "isolate"
        (a task asking for the network runs without it) or "refuse"; `reward_key` the primary
        reward of a reward.json with several and no ``reward``; `max_output_tokens` the output
        budget per call a harness is told (default: an eighth of the served model's window)."""
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive; got {max_output_tokens}")
        self.tasks_all = {t.task_id: t for t in load_tasks(path or EXAMPLES, internet=internet)}
        self.mix = None
        if tasks is not None:
            self.mix = WeightedMix.parse(
                tasks,
                TaskOptions,
                key="tasks",
                what="harbor task",
                example="['fix-greeting']",
                salt=self.name,
            )
            unknown = [n for n in self.mix.names if n not in self.tasks_all]
            if unknown:
                raise TaskError(
                    f"tasks: no harbor task {unknown[0]!r} under the path; there are {sorted(self.tasks_all)}"
                )
        self.agent = make_agent(agent, AgentOptions(max_turns, max_tokens, tool_timeout_s, max_output_tokens))
        self.backend = resolve_backend(backend)
        self.reward_key = reward_key

    def tasks(self, seed: int) -> Iterator[Episode]:
        if self.mix is None:
            import random

            names = sorted(self.tasks_all)
            random.Random(seed).shuffle(names)
            yield from (Episode(n, self.tasks_all[n]) for n in names)
            return
        for draw in self.mix.draws(seed):
            yield Episode(f"{draw.entry.name}/d{draw.index}", self.tasks_all[draw.entry.name])

    async def rollout(self, session: Session | None, task: Episode) -> Reward:
        # An agent's own sampling (a harness sends no temperature) is overruled by the session's:
        # the gateway applies it to every call (gateway/sessions/sampling.py).
        log = EpisodeLog()
        metrics: dict[str, float] = {}
        try:
            async with log.timed("sandbox"):
                built = await build_environment(task.task, self.backend)
            metrics["env/build_cache_hit"] = float(built.cache_hit)
            async with self.agent.attempt(session, self.model, log, metrics) as attempt:
                async with Trial.open(
                    task.task, built, self.backend, attempt.mounts, attempt.address_space_mb
                ) as trial:
                    await attempt.run(trial)
                    async with log.timed("grade"):
                        rewards = await trial.verify(self.reward_key)
        except SandboxError as exc:  # the sandbox died under the episode: failed, never trained
            raise sandbox_failed(exc) from exc
        named = {f"reward/{k}": v for k, v in rewards.named.items()}
        return Reward(rewards.value, log.metrics(**metrics, **named))
