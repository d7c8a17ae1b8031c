"""Every wait of a run: bounded by the step's deadline, watching the boxes between polls.

    waiter = Waiter(supervisor, timeout_s=cfg.run.step_timeout_s)
    waiter.start_step(step)                                  # a new deadline, named "step k+1"
    metrics = waiter.get(cluster.trainer_call("train", ...), "training")[0]
    waiter.call(lambda: feed.ack(cursors), "acknowledging the spool cursors")  # an HTTP call to a server

A wait that outlives the deadline raises `StepTimeout` with the phase it was in. Between polls the
watched object (`supervisor.Supervisor`; `Cluster.check_alive` unsupervised) checks the servers: a
server that exited is restarted there (or the run fails, naming it, its exit code and log tail), and
the wait goes on. A call whose actor died goes to `actor_died`, which replaces the actor and raises
`Replaced` (the run redoes the work from its state) or fails the run. So nothing hangs silently.

The driver's own HTTP calls to the servers (the gateway's sample cursor and admin, the engines'
versions) go through `call`: a call that cannot reach its server checks the servers (restarting a
dead one) and is made again, under the same deadline. No call of the driver's to a supervised
server bypasses this.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import httpx

from palaestra.orchestrator.errors import RunFailed, StepTimeout, root_cause

__all__ = ["Waiter"]

T = TypeVar("T")
RETRIED_STATUS = (408, 429)
"""4xx answers worth another try; any other 4xx fails the run at once (a wrong key, a bad request)."""


class Watched(Protocol):
    """What a Waiter checks between polls (`Cluster`; tests pass a stand-in)."""

    def check_alive(self, phase: str) -> bool | None:
        """Raises, or repairs what died (True if it repaired anything)."""


class Waiter:
    """Waits on Ray refs with the step's deadline, checking the servers between polls."""

    def __init__(self, cluster: Watched, timeout_s: float, poll_s: float = 2.0):
        self.cluster, self.timeout_s, self.poll_s = cluster, timeout_s, poll_s
        self.deadline = math.inf
        self.label = "start-up"
        self.unreachable = ""  # the last HTTP error `_ready` saw (the timeout message names it)

    def start_step(self, step: int) -> None:
        self.begin(f"step {step + 1}")

    def begin(self, label: str) -> None:
        """A new bounded piece of work (a step, an evaluation, a checkpoint) named `label`."""
        self.label, self.deadline = label, time.monotonic() + self.timeout_s

    def get(
        self,
        refs: list,
        phase: str,
        *,
        progress: Callable[[], str] | None = None,
        again: Callable[[], list] | None = None,
        redo: bool = False,
    ) -> list:
        """The refs' results. `again` re-issues the call (new refs) when it failed because a server
        died and was restarted meanwhile (an idempotent call: a weight sync). `redo`: the run may
        abandon this wait and redo its work, so a pending fault (`Supervisor.pending`) is raised."""
        import ray

        pending = list(refs)
        self._pending(redo)
        repaired = False  # a server restarted while the call ran: its failure may be that death's
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
                repaired = bool(self.cluster.check_alive(phase)) or repaired
                self._pending(redo)
        try:
            return ray.get(list(refs))
        except ray.exceptions.RayActorError as exc:
            died = getattr(self.cluster, "actor_died", None)
            if died is not None:
                died(exc, phase)  # replaces it and raises Replaced, or fails the run
            raise RunFailed(f"{self.label}, {phase}: {root_cause(exc)}") from None
        except ray.exceptions.RayError as exc:
            # a dead engine explains a failed call best; restarted (now, or by a check while the call
            # ran: an engine killed inside a weight sync is back before the sync gives up on it),
            # the call may be tried again
            if (self.cluster.check_alive(phase) or repaired) and again is not None:
                return self.get(again(), phase, progress=progress, redo=redo)
            raise RunFailed(f"{self.label}, {phase}: {root_cause(exc)}") from None

    def call(self, fn: Callable[[], T], phase: str, *, unreachable: tuple[type[Exception], ...] = ()) -> T:
        """`fn()`, one HTTP call (or a few) of the driver's to a supervised server. While the server
        cannot be reached (a connection error, a 5xx), the servers are checked, a dead one is
        restarted, and `fn` is called again, until it answers or the deadline passes (`StepTimeout`
        naming the phase and the last error). `fn` must be safe to repeat: a read, an
        acknowledgement, pause / resume. A 4xx answer fails the run at once, with the answer.

        `unreachable`: the errors `fn` raises itself when it could not reach a server after its own
        retries (e.g. `WeightSyncError`): `fn` is called again if the check restarted a server,
        else the run fails with the error."""
        result: list[T] = []

        def ready() -> bool:
            try:
                result.append(fn())
            except unreachable as exc:
                if self.cluster.check_alive(phase):
                    return False
                raise RunFailed(f"{self.label}, {phase}: {exc}") from None
            return True

        self.wait_until(ready, phase, lambda: self.unreachable or "no answer")
        return result[0]

    def wait_until(
        self, ready: Callable[[], bool], phase: str, progress: Callable[[], str], *, redo: bool = False
    ) -> None:
        """Polls `ready()` until it holds, under the same deadline and liveness checks."""
        checked = time.monotonic()
        self._pending(redo)
        self.unreachable = ""
        while not self._ready(ready, phase):
            now = time.monotonic()
            if now >= self.deadline:
                raise StepTimeout(
                    f"{self.label} exceeded run.step_timeout_s={self.timeout_s:g} s during "
                    f"{phase} ({progress()}); the run stops"
                )
            if now - checked >= self.poll_s:
                self.cluster.check_alive(phase)
                self._pending(redo)
                checked = now
            time.sleep(0.1)

    def _pending(self, redo: bool) -> None:
        take = getattr(self.cluster, "take_pending", None)
        if redo and take is not None and (fault := take()) is not None:
            raise fault

    def _ready(self, ready: Callable[[], bool], phase: str) -> bool:
        """`ready()`; False while the server it asks cannot be reached (the check that follows
        restarts it), the dead actor's fate to `actor_died`. A 4xx answer fails the run."""
        import ray

        try:
            return ready()
        except httpx.HTTPStatusError as exc:
            code = exc.response.status_code
            if code < 500 and code not in RETRIED_STATUS:
                raise RunFailed(
                    f"{self.label}, {phase}: {exc.request.method} {exc.request.url} answered {code}: "
                    f"{exc.response.text[:500]}"
                ) from None
            self.unreachable = f"{exc.request.url} answered {code}"
            self.cluster.check_alive(phase)
            return False
        except httpx.HTTPError as exc:
            where = f"{exc.request.url}: " if _has_request(exc) else ""
            self.unreachable = f"{where}{type(exc).__name__}: {exc}"
            self.cluster.check_alive(phase)
            return False
        except ray.exceptions.RayActorError as exc:
            died = getattr(self.cluster, "actor_died", None)
            if died is not None:
                died(exc, phase)
            raise RunFailed(f"{self.label}, {phase}: {root_cause(exc)}") from None


def _has_request(exc: httpx.HTTPError) -> bool:
    try:
        exc.request  # noqa: B018 (raises RuntimeError when the error has no request)
    except RuntimeError:
        return False
    return True
