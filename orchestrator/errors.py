"""Why a run stops: `RunFailed` (and `StepTimeout`), with the failing box, the phase and its log;
and why a step starts over: `Replaced` (a box whose work cannot be resumed was replaced).

Every part of the orchestrator raises these; `palaestra train` prints a RunFailed's message and
exits 1, and catches `Replaced` to redo the run from its state (`loop.Run.recover`).
"""

from __future__ import annotations

__all__ = ["Replaced", "RunFailed", "StepTimeout", "root_cause"]


class RunFailed(RuntimeError):
    """The run cannot go on: the message says which box failed, in which phase, and where its log is."""


class StepTimeout(RunFailed):
    """A step took longer than `run.step_timeout_s`."""


class Replaced(Exception):  # noqa: N818 (not an error: the run goes on)
    """`component` ("environment runner" or "trainer") died and the supervisor replaced it (or
    must, for the trainer); the work it had in flight is gone, so the run redoes it from its state."""

    def __init__(self, component: str, detail: str, started: float):
        super().__init__(f"{component} died: {detail}")
        self.component, self.detail, self.started = component, detail, started


def root_cause(exc: BaseException) -> str:
    """The innermost error of a Ray exception, one paragraph (not Ray's whole wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
