"""Where each training step's groups come from, per `run.mode` (what overlaps with training).

* `SyncSource`: generate step k, then train on it (lag 0);
* `OneStepOffSource`: generation of step k+1 runs while step k trains (lag exactly 1);
* `AsyncSource`: continuous generation, at most (1 + max_staleness) steps ahead, the gateway
  paused around every weight sync; with `run.partial_rollouts` (the default) the sync interrupts
  the calls in flight and the gateway continues them on the new weights, else it drains them first.

The run (`loop.Run`) calls `begin`, then per step `batch` → train → `before_sync` → sync →
`after_sync`, and `end` last. What trains of the groups is `batching.select_batch`'s decision.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from palaestra.config import RunConfig
from palaestra.orchestrator.batching import Batch, SampleFeed, select_batch
from palaestra.orchestrator.cluster import Cluster, interrupting
from palaestra.orchestrator.errors import RunFailed
from palaestra.orchestrator.waiting import Waiter

__all__ = ["SOURCES", "AsyncSource", "OneStepOffSource", "Source", "SyncSource"]

log = logging.getLogger(__name__)


class Source:
    """Groups of samples for each step; subclasses decide what overlaps with training.

    Task indices start at `first` (every index below it was consumed); `skip` lists consumed
    indices above it (async mode consumes out of order; a resumed run must not redo them).
    `attempt` counts the sources before this one in the run: each fault that abandons generation
    in flight starts a new source from the run's state, whose groups carry the new attempt."""

    def __init__(
        self,
        cfg: RunConfig,
        cluster: Cluster,
        feed: SampleFeed,
        waiter: Waiter,
        first: int = 0,
        skip: Sequence[int] = (),
        attempt: int = 0,
    ):
        self.cfg, self.cluster, self.feed, self.waiter = cfg, cluster, feed, waiter
        self.attempt = attempt
        self.first, self.skip = first, list(skip)
        self.per_step = cfg.env.tasks_per_step
        self.next_index = first  # sync and one-step-off consume whole steps in order
        ds = cfg.trainer.dynamic_sampling
        # dynamic sampling drops flat groups only where rewards train (an OPD-only run keeps them)
        self.dynamic = ds.enabled and cfg.trainer.rewards_train
        self.filter_flat = cfg.env.filter_zero_variance_groups or self.dynamic
        self.max_rounds = ds.max_rounds if self.dynamic else 1
        # samples claimed from the feed for the batch being made: a fault before it is handed over
        # abandons them, and the run records them as not trained (`unused`), or none would
        self.held: dict[str, None] = {}

    def _indices(self, n: int | None = None) -> list[int]:
        first, self.next_index = self.next_index, self.next_index + (n or self.per_step)
        return list(range(first, self.next_index))

    def _launch(self, n: int | None = None):
        return self.cluster.rollout.run_groups.remote(self._indices(n), self.attempt)

    def _generation_progress(self) -> str:
        import ray

        try:
            status = ray.get(self.cluster.rollout.status.remote(), timeout=10)
        except ray.exceptions.RayError as exc:
            return f"the environment runner does not answer: {type(exc).__name__}"
        running = status["in_flight_groups"]
        return f"{len(running)} groups still running, task indices {running[:8]}"

    def _claim_all(self, records: list, phase: str) -> list[tuple[Any, list]]:
        """Reads the cursor until every record's samples are in (they are durable already)."""
        out: dict[int, list] = {}

        def ready() -> bool:
            self.feed.poll()
            for i, r in enumerate(records):
                if i not in out and (got := self._claim(r)) is not None:
                    out[i] = got
            return len(out) == len(records)

        self.waiter.wait_until(
            ready,
            phase,
            lambda: f"{len(out)}/{len(records)} groups' samples read from the gateway",
            redo=True,
        )
        return [(r, out[i]) for i, r in enumerate(records)]

    def _select(self, groups, trainer_version: int) -> Batch:
        run = self.cfg.run
        return select_batch(
            groups,
            trainer_version,
            run.max_staleness,
            run.stale_policy,
            self.filter_flat,
        )

    def begin(self, step: int) -> None:
        pass

    def _claim(self, record) -> list | None:
        """The feed's `claim`, its samples held until the batch is handed over."""
        got = self.feed.claim(record)
        if got is not None:
            self.held.update(dict.fromkeys(s.sample_id for s in got))
        return got

    def batch(self, step: int, trainer_version: int) -> Batch:
        """The step's batch; from now on the run answers for its samples (trained or not)."""
        batch = self._batch(step, trainer_version)
        self.held.clear()
        return batch

    def _batch(self, step: int, trainer_version: int) -> Batch:
        raise NotImplementedError

    def before_sync(self, step: int) -> float:
        """Whatever must happen before the weights move; returns seconds spent."""
        return 0.0

    def after_sync(self, step: int) -> None:
        pass

    def end(self) -> None:
        pass

    def unused(self) -> list[str]:
        """Sample ids this source took from the feed and did not hand to a step: those of a batch
        a fault abandoned while it was being made (async: also groups generated ahead that the run
        ended or a fault abandoned before they trained)."""
        return list(self.held)


class SyncSource(Source):
    """Generate step k, then train on it: every sample is on-policy (lag 0). With dynamic sampling,
    each further round generates as many new groups as flat ones were dropped, up to max_rounds."""

    def _round(self, n: int, trainer_version: int) -> Batch:
        records = self.waiter.get(
            [self._launch(n)], "generation", progress=self._generation_progress, redo=True
        )[0]
        return self._select(self._claim_all(records, "reading samples"), trainer_version)

    def _batch(self, step: int, trainer_version: int) -> Batch:
        batch = self._round(self.per_step, trainer_version)
        while len(batch.groups) < self.per_step and batch.rounds < self.max_rounds:
            batch.extend(self._round(self.per_step - len(batch.groups), trainer_version))
            batch.rounds += 1
        return batch


class OneStepOffSource(Source):
    """Generation of step k+1 runs while step k trains; the sync waits for it to end, so each
    batch was sampled by exactly the previous weights (lag 1, 0 for the first)."""

    def begin(self, step: int) -> None:
        self.ref = self._launch()

    def _batch(self, step: int, trainer_version: int) -> Batch:
        records = self.waiter.get([self.ref], "generation", progress=self._generation_progress, redo=True)[0]
        self.ref = self._launch() if step + 1 < self.cfg.run.steps else None
        return self._select(self._claim_all(records, "reading samples"), trainer_version)

    def before_sync(self, step: int) -> float:
        started = time.perf_counter()
        if self.ref is not None:
            self.waiter.get(
                [self.ref],
                "generation of the next step (before the weight sync)",
                progress=self._generation_progress,
            )
        return time.perf_counter() - started


class AsyncSource(Source):
    """Continuous generation; at most (1 + max_staleness) steps' groups are started ahead of
    training, and `select_batch` enforces the bound per sample. The gateway is paused for each weight
    sync: calls in flight are interrupted and continued on the new weights (partial rollouts), or,
    with `run.partial_rollouts: false`, drained first (they finish on the old weights)."""

    def begin(self, step: int) -> None:
        self.ready: deque = deque()  # (record, samples), in order of completion
        self.waiting: list = []  # finished records whose samples are not all read yet
        self.consumed = 0
        self.waiter.get(
            [self.cluster.rollout.start_stream.remote(self.first, self.skip, self._allowed(), self.attempt)],
            "starting the rollout stream",
        )

    def _allowed(self) -> int:
        return self.consumed + (1 + self.cfg.run.max_staleness) * self.per_step

    def _collect(self) -> bool:
        import ray

        try:
            self.waiting += ray.get(self.cluster.rollout.take_finished.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            raise  # the Waiter has it replaced
        except ray.exceptions.RayError as exc:
            raise RunFailed(f"the environment runner failed: {exc}") from None
        self.feed.poll()
        still = []
        for r in self.waiting:
            got = self.feed.claim(r)  # held in `ready` until a batch takes it
            (still.append(r) if got is None else self.ready.append((r, got)))
        self.waiting = still
        return bool(self.ready)

    def _batch(self, step: int, trainer_version: int) -> Batch:
        merged, taken = Batch.empty(), 0
        # filtered groups are replaced by later ones (with dynamic sampling, up to max_rounds steps' worth)
        while len(merged.groups) < self.per_step and (
            not self.dynamic or taken < self.max_rounds * self.per_step
        ):
            self.waiter.wait_until(
                self._collect,
                "generation",
                lambda: f"{len(merged.groups)}/{self.per_step} groups ready for this step",
                redo=True,
            )
            self.consumed += 1
            taken += 1
            kept = len(merged.groups)
            record, samples = self.ready.popleft()
            self.held.update(dict.fromkeys(s.sample_id for s in samples))
            merged.extend(self._select([(record, samples)], trainer_version))
            if len(merged.groups) == kept:  # dropped: admit one more group in its place now, or a
                # step needing more than the admission limit's groups would wait for the next sync
                self.waiter.get([self.cluster.rollout.allow.remote(self._allowed())], "admitting more groups")
        merged.rounds = max(1, -(-taken // self.per_step))
        return merged

    def before_sync(self, step: int) -> float:
        started = time.perf_counter()
        # pausing twice is pausing (a gateway restarted meanwhile comes back unpaused: paused again);
        # with partial rollouts the calls in flight are not waited for: the sync interrupts them
        drain = not interrupting(self.cfg)
        self.waiter.call(
            lambda: self.cluster.pause_gateway(
                timeout_s=max(1.0, self.waiter.deadline - time.monotonic()), drain=drain
            ),
            "pausing the gateway for the weight sync",
        )
        return time.perf_counter() - started

    def after_sync(self, step: int) -> None:
        self.waiter.call(self.cluster.resume_gateway, "resuming the gateway")
        self.waiter.get([self.cluster.rollout.allow.remote(self._allowed())], "admitting more groups")

    def unused(self) -> list[str]:
        ahead = [s.sample_id for _, samples in getattr(self, "ready", ()) for s in samples]
        return [*super().unused(), *ahead]

    def end(self) -> None:
        import ray

        try:
            ray.get(self.cluster.rollout.stop_stream.remote(), timeout=60)
        except ray.exceptions.RayError as exc:  # the run is failing already: say so, go on stopping
            log.warning("stopping the rollout stream: %s", exc)


SOURCES = {"sync": SyncSource, "one_step_off": OneStepOffSource, "async": AsyncSource}
