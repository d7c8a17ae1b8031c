"""Running rollouts: groups of K samples per task, bounded concurrency, retries, progress, summary.

    summary = await run_rollouts(env, GatewayClient(url, key), tasks, samples_per_task=4, concurrency=16)
    print(summary.line())

Each task's K episodes share one `group_id` (`env/task_id/run`), so GRPO-style estimators normalise
within the group. An episode is one session, or, for an environment whose `seats(task)` is N > 1
(self-play: every seat of a two-player game played by the policy), N sessions of the group played
together by `env.play(sessions, task)`, each seat rewarded on its own session: a group then holds
K x N samples, and the summary one result per seat. Every task is checked against the task contract (`environment.check_task`) before
the first session starts. A rollout that raises closes its session as `failed` (never trained on)
and is counted; transient gateway errors (unreachable, 429, 5xx) on session calls are retried with
backoff. The summary gives the mean reward and the mean of each metric the environment returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import statistics
import time
import traceback as _traceback
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from palaestra.sdk.environment import Environment, as_reward, check_task
from palaestra.sdk.session import EpisodeFailed, GatewayClient, GatewayError, failed_metrics

FAILURE_PREFIX = "failure/"  # what went wrong in an episode, counted per rollout


@dataclass
class RolloutResult:
    task_id: str
    group_id: str
    session_id: str | None
    reward: float
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    sample_ids: list[str] = field(default_factory=list)
    sampled_tokens: int = 0
    error: str | None = None
    where: str = ""
    """Where the episode's error was raised: ``path:line in function`` (`--show`, the failures list)."""
    traceback: str = ""
    """The error's traceback (`palaestra rollout -v`)."""
    failure: str | None = None
    """Why a failed episode failed: `EpisodeFailed`'s reason (``sandbox_error``: not the agent's
    doing), ``error`` for any other exception, ``session`` when its session could not start."""


class Refused(RuntimeError):
    """The gateway refused the run's key (401/403): every episode would fail the same way, so the
    run stops at the first (`run_rollouts`)."""


def _failed(task_id: str, group_id: str, session_id: str | None, exc: BaseException) -> RolloutResult:
    """A failed episode's result, with where `exc` was raised and its traceback."""
    from palaestra.sdk.show import error_where

    return RolloutResult(
        task_id,
        group_id,
        session_id,
        0.0,
        "failed",
        error=f"{type(exc).__name__}: {exc}",
        where=error_where(exc),
        traceback="".join(_traceback.format_exception(exc)),
        failure=exc.reason if isinstance(exc, EpisodeFailed) else "error",
    )


def _refused(exc: Exception) -> None:
    """Raises `Refused` when `exc` is the gateway refusing the run's key."""
    if isinstance(exc, GatewayError) and exc.status in (401, 403):
        raise Refused(str(exc)) from exc


@dataclass
class RolloutSummary:
    results: list[RolloutResult]
    wall_s: float

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results if r.status != "failed"]

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.rewards) if self.rewards else float("nan")

    @property
    def reward_std(self) -> float:
        return statistics.pstdev(self.rewards) if len(self.rewards) > 1 else 0.0

    @property
    def statuses(self) -> dict[str, int]:
        return dict(Counter(r.status for r in self.results))

    @property
    def sampled_tokens(self) -> int:
        return sum(r.sampled_tokens for r in self.results)

    @property
    def metrics(self) -> dict[str, float]:
        """The mean of each metric the environment returned (`Reward.metrics`), over the rollouts
        that did not fail; a rollout without a metric counts 0 for it (as the training run's
        `rollout/env_<metric>` does)."""
        scored = [r for r in self.results if r.status != "failed"]
        keys = sorted({k for r in scored for k in r.metrics})
        return {k: statistics.fmean(r.metrics.get(k, 0.0) for r in scored) for k in keys}

    def line(self) -> str:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items()))
        return (
            f"{len(self.results)} rollouts in {self.wall_s:.1f} s: reward {self.reward_mean:.3f} ± "
            f"{self.reward_std:.3f}; {statuses}; {self.sampled_tokens} sampled tokens "
            f"({self.sampled_tokens / max(self.wall_s, 1e-9):.0f}/s)"
        )

    def metrics_line(self) -> str:
        """``metrics (mean over N rollouts): correct 0.500, tool_calls 1.250; failures: none`` ('' without
        metrics). Of the ``failure/<name>`` counters only those that happened are named (an
        environment reports every one it knows, mostly at 0); `metrics` keeps them all."""
        metrics = self.metrics
        if not metrics:
            return ""
        n = sum(r.status != "failed" for r in self.results)
        failures = {
            k.removeprefix(FAILURE_PREFIX): v for k, v in metrics.items() if k.startswith(FAILURE_PREFIX)
        }
        line = f"metrics (mean over {n} rollouts): " + ", ".join(
            f"{k} {v:.3f}" for k, v in metrics.items() if not k.startswith(FAILURE_PREFIX)
        )
        if failures:
            happened = ", ".join(f"{k} {v:.3f}" for k, v in failures.items() if v)
            line += f"; failures: {happened or 'none'}"
        return line


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sane at 0, 1 and small n)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def take_tasks(env: Environment, n: int, seed: int) -> list[Any]:
    return list(itertools.islice(iter(env.tasks(seed)), n))


class StrataError(ValueError):
    """A kind the environment names that its task stream does not yield."""


def stratified_tasks(env: Environment, n: int, seed: int) -> list[Any]:
    """`n` tasks of `env.tasks(seed)` stratified over the kinds the environment names
    (`Environment.kinds()`: reasoning-gym's datasets, TextArena's games, math's task kinds, a mix's
    members): each kind gets n // k tasks, the first n % k kinds one more, taken in stream order,
    so a kind is never left out by chance. Without named kinds, the first `n` tasks (`take_tasks`)."""
    kinds = list(dict.fromkeys(env.kinds() or ()))
    if len(kinds) < 2:
        return take_tasks(env, n, seed)
    quota = {kind: n // len(kinds) + (i < n % len(kinds)) for i, kind in enumerate(kinds)}
    out: list[Any] = []
    wanted, drawn = sum(quota.values()), -1
    for drawn, task in enumerate(env.tasks(seed)):
        kind = getattr(task, "kind", None)
        if quota.get(kind, 0) > 0:
            quota[kind] -= 1
            out.append(task)
            if len(out) == wanted:
                return out
        if drawn >= 1000 + 100 * n:
            break
    short = [kind for kind, left in quota.items() if left > 0]
    raise StrataError(
        f"environment {env.name!r} names the kinds {kinds} but its tasks({seed}) yielded too few of "
        f"{short} in {drawn + 1} tasks; give them more weight or fewer --tasks"
    )


def standard_error(p: float, n: int) -> float:
    """The standard error of an accuracy `p` measured on `n` tasks, sqrt(p(1-p)/n); nan for none."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else float("nan")


def within_noise(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Whether two accuracies, each (accuracy, tasks), differ by less than two standard errors of
    their difference (0.10 and 0.25 on 20 tasks each: within noise). Equal accuracies are."""
    (pa, na), (pb, nb) = a, b
    if na == 0 or nb == 0:
        return True
    # the pooled proportion keeps a difference between 0 and 0 (or 1 and 1) from being "significant"
    pooled = (pa * na + pb * nb) / (na + nb)
    se = math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / na + 1 / nb))
    return abs(pa - pb) <= 2 * se


def episode_seed(base: int | str, index: int) -> int:
    """A 31-bit sampling seed for episode `index` of a run seeded with `base` (stable everywhere)."""
    digest = hashlib.sha256(f"palaestra.episode/{base}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


async def _one(
    env: Environment, gateway: GatewayClient, task: Any, group_id: str, sampling: Mapping[str, Any]
) -> list[RolloutResult]:
    """One episode of `task`: one session, or `env.seats(task)` sessions of the group (`play`)."""
    seats = env.seats(task)
    if seats == 1:
        return [await _single(env, gateway, task, group_id, sampling)]
    return await _seated(env, gateway, task, group_id, sampling, seats)


async def _single(
    env: Environment, gateway: GatewayClient, task: Any, group_id: str, sampling: Mapping[str, Any]
) -> RolloutResult:
    task_id = str(task.task_id)  # checked by run_rollouts (check_task)
    try:
        session = await gateway.session(env=env.name, task_id=task_id, group_id=group_id, sampling=sampling)
    except Exception as exc:  # could not even start: counted, nothing to close
        _refused(exc)
        return RolloutResult(
            task_id, group_id, None, 0.0, "failed", error=f"session: {exc}", failure="session"
        )
    try:
        async with session:
            reward = as_reward(await env.rollout(session, task))
            done = await session.reward(reward.value, reward.metrics)
        return _finished(task_id, group_id, session.session_id, reward, done)
    except Exception as exc:  # the session was closed as failed by its context manager
        return _failed(task_id, group_id, session.session_id, exc)


def _finished(
    task_id: str, group_id: str, session_id: str, reward: Any, done: Mapping[str, Any]
) -> RolloutResult:
    return RolloutResult(
        task_id,
        group_id,
        session_id,
        reward.value,
        done.get("status", "completed"),
        reward.metrics,
        done.get("sample_ids", []),
        int(done.get("sampled_tokens", 0)),
    )


async def _seated(
    env: Environment,
    gateway: GatewayClient,
    task: Any,
    group_id: str,
    sampling: Mapping[str, Any],
    seats: int,
) -> list[RolloutResult]:
    """One episode played over `seats` sessions of one group (seat i's session has metadata
    ``{"seat": i}``); each seat's reward is posted to its own session. If the episode raises, every
    seat's session closes as failed."""
    task_id = str(task.task_id)
    sessions: list[Any] = []
    try:
        for seat in range(seats):
            sessions.append(
                await gateway.session(
                    env=env.name,
                    task_id=task_id,
                    group_id=group_id,
                    metadata={"seat": seat},
                    sampling=sampling,
                )
            )
    except Exception as exc:
        _refused(exc)
        for s in sessions:  # the seats that did open: closed, nothing trained on
            with contextlib.suppress(Exception):
                await s.reward(0.0, {"error": 1.0}, status="failed")
        return [
            RolloutResult(task_id, group_id, None, 0.0, "failed", error=f"session: {exc}", failure="session")
            for _ in range(seats)
        ]
    try:
        rewards = [as_reward(r) for r in await env.play(sessions, task)]
        if len(rewards) != seats:
            raise TypeError(f"{env.name}.play returned {len(rewards)} rewards for {seats} seats")
        results = []
        for session, reward in zip(sessions, rewards, strict=True):
            done = await session.reward(reward.value, reward.metrics)
            results.append(_finished(task_id, group_id, session.session_id, reward, done))
        return results
    except Exception as exc:
        for s in sessions:
            if not s.finished:
                with contextlib.suppress(Exception):
                    await s.reward(0.0, failed_metrics(exc), status="failed")
        return [_failed(task_id, group_id, s.session_id, exc) for s in sessions]


async def run_rollouts(
    env: Environment,
    gateway: GatewayClient,
    tasks: Iterable[Any],
    *,
    samples_per_task: int = 1,
    concurrency: int = 8,
    progress: bool = True,
    run_id: str | None = None,
    sampling: Mapping[str, Any] | None = None,
    seed: int | str | None = None,
    label: str = "rollout",
) -> RolloutSummary:
    """Runs `samples_per_task` episodes per task (one session each, or `env.seats(task)`), at most
    `concurrency` episodes at once. Every session's
    `session.sampling` is `sampling` (e.g. `{"temperature": 1.0}`); with `seed`, episode j (tasks in
    order, then their samples) adds its own `"seed": episode_seed(seed, j)`. A task that breaks the
    task contract raises `TaskError` before any session starts; a gateway that refuses the key
    raises `Refused` at the first episode and cancels the rest. `label` names the progress bar."""
    run_id = run_id or uuid.uuid4().hex[:8]
    checked = [(task, check_task(env, task)) for task in tasks]  # the task contract, before any session
    jobs = [
        (task, f"{env.name}/{task_id}/{run_id}") for task, task_id in checked for _ in range(samples_per_task)
    ]
    sem = asyncio.Semaphore(concurrency)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc=f"{label} {env.name}", unit="ep", dynamic_ncols=True)
    rewards: list[float] = []
    sampling = dict(sampling or {})

    async def guarded(j: int, task: Any, group: str) -> list[RolloutResult]:
        episode = sampling if seed is None else {**sampling, "seed": episode_seed(seed, j)}
        async with sem:
            results = await _one(env, gateway, task, group, episode)
        rewards.extend(r.reward for r in results if r.status != "failed")
        if bar is not None:
            bar.set_postfix(reward=f"{statistics.fmean(rewards):.3f}" if rewards else "-", refresh=False)
            bar.update(1)
        return results

    t0 = time.perf_counter()
    running = [asyncio.ensure_future(guarded(j, t, g)) for j, (t, g) in enumerate(jobs)]
    try:
        episodes = await asyncio.gather(*running)
    finally:  # a `Refused` (or a cancelled run) stops the episodes still running
        for job in running:
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if bar is not None:
            bar.close()
    return RolloutSummary([r for results in episodes for r in results], time.perf_counter() - t0)
