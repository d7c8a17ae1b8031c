"""`RolloutWorker`, the Ray actor that runs the environment: groups of `samples_per_task` sessions
per task through the gateway (`palaestra.sdk.runner.run_rollouts`, with the run's sampling
settings), either a given range of task indices (sync, one-step-off) or a continuous stream
bounded by an admission limit (async), and the held-out evaluations (scored by
`palaestra.sdk.scoring`). Each finished group comes back as a `batching.GroupRecord`. Every session
it opens and finishes is noted in a ledger file, so that when its process dies the driver finishes
the sessions it left open as aborted (`ledger.py`). `TaskSource` reads task `i` of an environment.

The class is plain Python: `ray.remote(RolloutWorker)` makes it an actor, tests may use it directly.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from palaestra.orchestrator.batching import TRAINABLE, GroupRecord
from palaestra.orchestrator.ledger import group_run_id, ledgered_client
from palaestra.orchestrator.nodes import where

__all__ = ["RolloutWorker", "TaskSource"]


class TaskSource:
    """Task `i` of `env.tasks(seed)`, for any i: a finite task list wraps around, pass p reading
    `env.tasks(seed + p)`. Sequential reads are O(1); going back restarts the iterator."""

    def __init__(self, env, seed: int):
        self.env, self.seed = env, seed
        self.length: int | None = None
        self._start(0)

    def _start(self, epoch: int) -> None:
        self._epoch, self._pos, self._last = epoch, 0, None
        self._it = iter(self.env.tasks(self.seed + epoch))

    def get(self, index: int) -> Any:
        from palaestra.sdk.environment import check_task

        epoch, offset = divmod(index, self.length) if self.length else (0, index)
        if epoch != self._epoch or offset < self._pos - 1:
            self._start(epoch)
        if offset == self._pos - 1:
            return self._last
        while self._pos <= offset:
            try:
                self._last = next(self._it)
                check_task(self.env, self._last)  # the task contract, with what to change
            except StopIteration:
                if self._pos == 0:
                    raise ValueError(f"environment {self.env.name!r}: tasks() yielded no task") from None
                self.length = self._pos
                return self.get(index)
            self._pos += 1
        return self._last


class RolloutWorker:
    """Runs the environment's rollouts through the gateway (a Ray async actor: one event loop)."""

    def __init__(
        self,
        env_name: str,
        env_args: dict[str, Any],
        sampling: dict[str, Any],
        gateway_url: str,
        api_key: str,
        seed: int,
        samples_per_task: int,
        concurrency: int,
        run_id: str,
        ledger: str | None = None,
    ):
        from palaestra.sdk import load_environment

        self.env = load_environment(env_name, **env_args)
        # Every session gets these (`session.sampling`, plus its episode's seed): the trainer's
        # logprobs are only right at the temperature the rollouts were sampled at.
        self.sampling = dict(sampling)
        self.env_name, self.env_args = env_name, env_args
        self.gateway = ledgered_client(gateway_url, api_key, ledger)
        self.tasks = TaskSource(self.env, seed)
        self.tasks.get(0)  # a task without a task_id fails the start, not the first step
        self.seed = seed
        self.samples_per_task = samples_per_task
        self.group_slots = max(1, concurrency // samples_per_task)
        self.run_id = run_id
        self._slots = asyncio.Semaphore(self.group_slots)
        self._done: list[GroupRecord] = []
        self._in_flight: set[int] = set()
        self._stream: asyncio.Task | None = None
        self._stream_error: str | None = None
        self._allowed = self._started = 0
        self._allowed_changed = asyncio.Event()

    def info(self) -> dict[str, Any]:
        return {"env": self.env.name, "sampling": self.sampling, "node": where(), "pid": os.getpid()}

    async def _group(self, index: int, attempt: int) -> GroupRecord:
        from palaestra.sdk.runner import run_rollouts

        task = self.tasks.get(index)
        started = time.time()
        summary = await run_rollouts(
            self.env,
            self.gateway,
            [task],
            samples_per_task=self.samples_per_task,
            concurrency=self.samples_per_task,
            progress=False,
            run_id=group_run_id(self.run_id, index, attempt),
            sampling=self.sampling,
            seed=f"{self.seed}/{index}",  # group `index` samples alike in every run of this seed
        )
        ok = [r for r in summary.results if r.status in TRAINABLE]
        keys = sorted({k for r in ok for k in r.metrics})
        return GroupRecord(
            task_index=index,
            task_id=str(task.task_id),
            group_id=summary.results[0].group_id,
            sample_ids=[s for r in ok for s in r.sample_ids],
            rewards=[r.reward for r in ok],
            statuses=dict(Counter(r.status for r in summary.results)),
            metrics={k: statistics.fmean(r.metrics.get(k, 0.0) for r in ok) for k in keys},
            sampled_tokens=sum(r.sampled_tokens for r in ok),
            longest_tokens=max((r.sampled_tokens for r in ok), default=0),
            started=started,
            finished=time.time(),
            errors=[r.error for r in summary.results if r.error][:3],
            failures=dict(Counter(r.failure or "error" for r in summary.results if r.status == "failed")),
            kind=kind if isinstance(kind := getattr(task, "kind", None), str) else None,
        )

    async def _slotted(self, index: int, attempt: int) -> GroupRecord:
        try:
            return await self._group(index, attempt)
        finally:
            self._in_flight.discard(index)
            self._slots.release()

    async def run_groups(self, indices: Sequence[int], attempt: int = 0) -> list[GroupRecord]:
        """The groups of these task indices (at most `concurrency` sessions at once), in order;
        `attempt` tells groups redone after a fault from the first try (`group_run_id`)."""

        async def one(i: int) -> GroupRecord:
            await self._slots.acquire()
            self._in_flight.add(i)
            return await self._slotted(i, attempt)

        return list(await asyncio.gather(*(one(i) for i in indices)))

    # -- async mode: a continuous stream -------------------------------------------------------
    async def start_stream(self, first: int, skip: Sequence[int], allowed: int, attempt: int = 0) -> None:
        """Starts groups for task indices first, first+1, ... (leaving out `skip`) while fewer than
        `allowed` groups have been started by this stream and a group slot is free."""
        if self._stream is not None:
            raise RuntimeError("the rollout stream is already running")
        self._allowed, self._started = allowed, 0
        self._stream = asyncio.get_running_loop().create_task(self._run_stream(first, set(skip), attempt))

    async def _run_stream(self, index: int, skip: set[int], attempt: int) -> None:
        def record(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                self._stream_error = f"{type(task.exception()).__name__}: {task.exception()}"
            else:
                self._done.append(task.result())

        pending: set[asyncio.Task] = set()
        try:
            while True:
                while index in skip:
                    index += 1
                while self._started >= self._allowed:
                    self._allowed_changed.clear()
                    await self._allowed_changed.wait()
                await self._slots.acquire()
                self._started += 1
                self._in_flight.add(index)
                task = asyncio.get_running_loop().create_task(self._slotted(index, attempt))
                task.add_done_callback(record)
                pending.add(task)
                task.add_done_callback(pending.discard)
                index += 1
        except asyncio.CancelledError:
            for task in pending:
                task.cancel()
            # Their sessions finish (as failed) before the stream counts as stopped, so the run's
            # last read of the spool sees every sample they leave.
            await asyncio.gather(*pending, return_exceptions=True)
            raise

    async def allow(self, allowed: int) -> None:
        """Raises the admission limit: the stream may have started `allowed` groups in all."""
        self._allowed = max(self._allowed, allowed)
        self._allowed_changed.set()

    async def take_finished(self) -> list[GroupRecord]:
        """Groups finished since the last call (async mode)."""
        if self._stream_error is not None:
            raise RuntimeError(f"the rollout stream failed: {self._stream_error}")
        done, self._done = self._done, []
        return done

    async def stop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            try:
                await self._stream
            except asyncio.CancelledError:
                pass
            self._stream = None

    async def status(self) -> dict[str, Any]:
        return {"in_flight_groups": sorted(self._in_flight), "finished_waiting": len(self._done)}

    # -- held-out evaluation -------------------------------------------------------------------
    async def evaluate(self, n: int, seed: int, tag: str, concurrency: int) -> dict[str, float]:
        """Greedy accuracy on `n` tasks of `env.tasks(seed)`, stratified over the kinds the
        environment names as `palaestra eval`'s are (`stratified_tasks`; `palaestra.sdk.scoring.score`)."""
        from palaestra.sdk import load_environment
        from palaestra.sdk.runner import run_rollouts, stratified_tasks
        from palaestra.sdk.scoring import score

        env = load_environment(self.env_name, **self.env_args)
        tasks = stratified_tasks(env, n, seed)
        summary = await run_rollouts(
            env,
            self.gateway,
            tasks,
            samples_per_task=1,
            concurrency=concurrency,
            progress=False,
            run_id=f"eval-{self.run_id}-{tag}",
            sampling={**self.sampling, "temperature": 0.0},
        )
        return {**score(tasks, summary.results), "reward_mean": summary.reward_mean, "wall_s": summary.wall_s}

    async def close(self) -> None:
        await self.stop_stream()
        await self.gateway.close()
