"""Why a run stops: `RunFailed` (and `StepTimeout`), with the failing box, the phase and its log.

Every part of the orchestrator raises these; `palaestra train` prints the message and exits 1.
"""

from __future__ import annotations

__all__ = ["RunFailed", "StepTimeout", "root_cause"]


class RunFailed(RuntimeError):
    """The run cannot go on: the message says which box failed, in which phase, and where its log is."""


class StepTimeout(RunFailed):
    """A step took longer than `run.step_timeout_s`."""


def root_cause(exc: BaseException) -> str:
    """The innermost error of a Ray exception, one paragraph (not Ray's whole wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
