"""Is a Harbor task a usable training task? Its oracle must score full, and the empty attempt not.

    result = await validate_task("environments/harbor/examples/fix-greeting", backend)
    result.valid, result.reason        # True, "oracle 1, empty attempt 0"

Both attempts run as episodes do (the environment built, a fresh sandbox each, test.sh as the
verifier) with the SCRIPTED agents ``oracle`` (solution/solve.sh) and ``none``. "Full" is the
primary reward at least `full` (1.0). A task that does not load, does not build, whose verifier
cannot grade, or has no solution is invalid, with that reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from palaestra.environments.episode import EpisodeLog
from palaestra.environments.harbor.agents import make_agent
from palaestra.environments.harbor.build import build_environment
from palaestra.environments.harbor.dockerfile import DockerfileError
from palaestra.environments.harbor.task import HarborTask, TaskError, load_task
from palaestra.environments.harbor.trial import GraderFailure, Trial
from palaestra.sandbox.base import Backend, SandboxError

__all__ = ["Validation", "attempt_reward", "validate_task"]


@dataclass(frozen=True)
class Validation:
    task_id: str
    valid: bool
    reason: str
    oracle: float | None = None
    empty: float | None = None
    build_s: float | None = None
    cache_hit: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def attempt_reward(
    task: HarborTask, backend: Backend, agent: str, reward_key: str | None = None
) -> float:
    """The primary reward of one scripted attempt (`agent` "oracle" or "none") on `task`."""
    built = await build_environment(task, backend)
    metrics: dict[str, float] = {}
    async with make_agent(agent).attempt(None, "", EpisodeLog(), metrics) as attempt:
        async with Trial.open(task, built, backend, attempt.mounts) as trial:
            await attempt.run(trial)
            return (await trial.verify(reward_key)).value


async def validate_task(
    path: str | Path, backend: Backend, *, full: float = 1.0, reward_key: str | None = None
) -> Validation:
    name = Path(path).name
    try:
        task = load_task(path)
        if not task.has_solution:
            return Validation(name, False, "no solution/solve.sh: nothing shows the task can be solved")
        built = await build_environment(task, backend)
        oracle = await attempt_reward(task, backend, "oracle", reward_key)
        empty = await attempt_reward(task, backend, "none", reward_key)
    except (TaskError, DockerfileError, GraderFailure, SandboxError) as exc:
        return Validation(name, False, f"{type(exc).__name__}: {exc}")
    timing = {"build_s": built.build_s, "cache_hit": built.cache_hit}
    if oracle < full:
        return Validation(
            name, False, f"the oracle scores {oracle:g}, not full ({full:g})", oracle, empty, **timing
        )
    if empty >= full:
        return Validation(name, False, f"the empty attempt already scores {empty:g}", oracle, empty, **timing)
    return Validation(name, True, f"oracle {oracle:g}, empty attempt {empty:g}", oracle, empty, **timing)
