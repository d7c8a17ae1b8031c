"""Every wait of a run: bounded by the step's deadline, watching the servers between polls.

    waiter = Waiter(cluster, timeout_s=cfg.run.step_timeout_s)
    waiter.start_step(step)                                  # a new deadline, named "step k+1"
    metrics = waiter.get(cluster.trainer_call("train", ...), "training")[0]

A wait that outlives the deadline raises `StepTimeout` with the phase it was in; a server that
exits meanwhile raises `RunFailed` with its name, exit code and log tail (`Cluster.check_alive`),
so nothing hangs silently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from palaestra.orchestrator.errors import RunFailed, StepTimeout, root_cause

__all__ = ["Waiter"]


class Watched(Protocol):
    """What a Waiter checks between polls (`Cluster`; tests pass a stand-in)."""

    def check_alive(self, phase: str) -> None: ...


class Waiter:
    """Waits on Ray refs with the step's deadline, checking the servers between polls."""

    def __init__(self, cluster: Watched, timeout_s: float, poll_s: float = 2.0):
        self.cluster, self.timeout_s, self.poll_s = cluster, timeout_s, poll_s
        self.deadline = math.inf
        self.label = "start-up"

    def start_step(self, step: int) -> None:
        self.begin(f"step {step + 1}")

    def begin(self, label: str) -> None:
        """A new bounded piece of work (a step, an evaluation, a checkpoint) named `label`."""
        self.label, self.deadline = label, time.monotonic() + self.timeout_s

    def get(self, refs: list, phase: str, *, progress: Callable[[], str] | None = None) -> list:
        import ray

        pending = list(refs)
        while pending:
            left = self.deadline - time.monotonic()
            if left <= 0:
                detail = f" ({progress()})" if progress is not None else ""
                raise StepTimeout(
                    f"{self.label} exceeded run.step_timeout_s={self.timeout_s:g} s during "
                    f"{phase}{detail}; the run stops"
                )
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(self.poll_s, left))
            if pending:
                self.cluster.check_alive(phase)
        try:
            return ray.get(list(refs))
        except ray.exceptions.RayError as exc:
            self.cluster.check_alive(phase)  # a dead engine explains a failed call best
            raise RunFailed(f"{self.label}, {phase}: {root_cause(exc)}") from None

    def wait_until(self, ready: Callable[[], bool], phase: str, progress: Callable[[], str]) -> None:
        """Polls `ready()` until it holds, under the same deadline and liveness checks."""
        checked = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now >= self.deadline:
                raise StepTimeout(
                    f"{self.label} exceeded run.step_timeout_s={self.timeout_s:g} s during "
                    f"{phase} ({progress()}); the run stops"
                )
            if now - checked >= self.poll_s:
                self.cluster.check_alive(phase)
                checked = now
            time.sleep(0.1)
