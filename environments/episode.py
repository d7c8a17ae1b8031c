"""What the tool-using environments (code_sandbox, swe_agent) share: the record of one episode —
what went wrong, by name, and where the time went — and the sampling arguments of a session.

    log = EpisodeLog()
    async with log.timed("model"):
        reply = await session.client.chat.completions.create(..., **sampling(session, temperature=1.0))
    log.fail("tool_call_parse")                   # counted; the episode goes on
    return Reward(reward, log.metrics())          # failure/tool_call_parse: 1.0, time/model_s: ...

Failure names (each becomes the metric ``failure/<name>``, a count, in the sample's metrics and in
``GET /sessions/{id}``):

- ``tool_call_parse``: the model wrote a tool call that could not be used (text that looks like a
  call but was not parsed, arguments that are not a JSON object, a missing argument, an unknown
  tool); the model got the error back as the tool result;
- ``sandbox_timeout``: a command the agent ran was killed at its time limit;
- ``sandbox_error``: the sandbox itself failed (could not start, died);
- ``grader_error``: grading could not decide (the grader did not run, a patch did not apply cleanly
  is *not* one: that scores 0 as the agent's fault);
- ``context_exceeded``: the conversation outgrew the model's context; the episode was graded as it
  stood;
- ``no_answer``: the episode ended without an answer to grade (max turns, or no code / no submit).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

FAILURES = (
    "tool_call_parse",
    "sandbox_timeout",
    "sandbox_error",
    "grader_error",
    "context_exceeded",
    "no_answer",
)
PHASES = ("model", "sandbox", "grade")

# Text a model writes when it means to call a tool, in the chat formats the gateway parses. A reply
# with one of these and no parsed call is a malformed call, not an answer.
CALL_MARKERS = ("<tool_call>", "<|tool_call", "<function=", '{"name":', "<|python_tag|>")


def looks_like_a_tool_call(content: str | None) -> bool:
    return bool(content) and any(marker in content for marker in CALL_MARKERS)


@dataclass
class EpisodeLog:
    """Failures (named, counted) and seconds per phase of one episode."""

    failures: Counter = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: Counter = field(default_factory=Counter)

    def fail(self, name: str) -> None:
        if name not in FAILURES:
            raise ValueError(f"unknown failure {name!r}; one of {', '.join(FAILURES)}")
        self.failures[name] += 1

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    @contextlib.asynccontextmanager
    async def timed(self, phase: str) -> AsyncIterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self, **extra: float) -> dict[str, float]:
        out = {f"failure/{name}": float(self.failures[name]) for name in FAILURES}
        out |= {f"time/{phase}_s": round(s, 4) for phase, s in self.seconds.items()}
        out |= {name: float(n) for name, n in self.counts.items()}
        return out | {k: float(v) for k, v in extra.items()}


def sampling(session: Any, **defaults: Any) -> dict[str, Any]:
    """Keyword arguments for ``chat.completions.create``: the environment's defaults (temperature),
    overridden by what the run chose for this episode (``session.sampling``: seed, temperature)."""
    return {**defaults, **dict(session.sampling)}


def resolve_backend(backend: Any) -> Any:
    """A sandbox backend from a spec string (``palaestra.sandbox.get_backend``: "local", "docker",
    "http://host:port"), an import path ``package.module:Class`` (called with no arguments), or a
    ready `Backend`."""
    if not isinstance(backend, str):
        return backend
    from palaestra.plugins import is_import_path, load_object

    if is_import_path(backend):
        return load_object(backend, "sandbox backend", callable_=True)()
    from palaestra.sandbox import get_backend

    return get_backend(backend)
