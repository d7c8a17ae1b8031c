"""The code_sandbox environment: the model writes a Python function, may run code in a sandbox
with the `run_python` tool (OpenAI tools) while it works, and answers with the function in a code
block; hidden tests grade the answer in a fresh sandbox (`palaestra.verifiers.code`).

    palaestra rollout --env code --env-args '{"difficulty": 0, "backend": "local"}' --tasks 8

Reward: 1 when every hidden test passes, or the fraction passed with ``partial_credit``. Tasks come
from the seeded generator (`tasks.py`, levels 0-3) or HumanEval (``source="humaneval"``). What went
wrong in an episode is in its metrics (``failure/*``); a sandbox that fails (while the model
works or while grading) fails the episode, never trained (``sandbox_error``). The turns are
`environments/episode.py`'s `ToolLoop`, this module is the tool, the prompt and the grading.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from palaestra.environments.code_sandbox.tasks import LEVELS, CodeTask, iter_generated, load_humaneval
from palaestra.environments.code_sandbox.tools import RUN_PYTHON_TOOL, extract_code, run_python
from palaestra.environments.episode import EpisodeLog, ToolLoop, ToolResult, resolve_backend, sandbox_failed
from palaestra.sandbox.base import Limits, Sandbox, SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session
from palaestra.verifiers.code import grade_code

SYSTEM = (
    "You write Python functions. You may call the run_python tool to test your code before you "
    "answer. When you are done, answer with the complete function in a ```python code block."
)


class CodeSandboxEnv(Environment):
    name = "code"

    def __init__(
        self,
        source: str = "generated",
        difficulty: int = 0,
        backend: Any = "local",
        max_turns: int = 4,
        max_tokens: int = 512,
        temperature: float = 1.0,
        partial_credit: bool = False,
        tool_timeout_s: float = 5.0,
        grade_timeout_s: float = 10.0,
        memory_mb: int = 512,
    ):
        """`source` "generated" (with `difficulty` 0-3) or "humaneval"; `backend` a sandbox spec
        ("local", "docker", a remote URL) or a `Backend`; `max_turns` model calls per episode."""
        if source not in ("generated", "humaneval"):
            raise ValueError(f"source must be 'generated' or 'humaneval'; got {source!r}")
        if source == "generated" and difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {LEVELS}; got {difficulty!r}")
        self.loop = ToolLoop([RUN_PYTHON_TOOL], max_turns, max_tokens, temperature)
        self.source, self.difficulty, self.backend = source, difficulty, resolve_backend(backend)
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature
        self.partial_credit, self.tool_timeout_s, self.grade_timeout_s = (
            partial_credit,
            tool_timeout_s,
            grade_timeout_s,
        )
        self.limits = Limits(timeout_s=max(tool_timeout_s, grade_timeout_s), memory_mb=memory_mb)

    def tasks(self, seed: int) -> Iterable[CodeTask]:
        if self.source == "humaneval":
            return load_humaneval()
        return iter_generated(seed, self.difficulty)

    async def rollout(self, session: Session, task: CodeTask) -> Reward:
        log = EpisodeLog()
        box: Sandbox | None = None  # made at the first run_python call

        async def run_tool(name: str, args: dict[str, Any]) -> ToolResult:
            nonlocal box
            try:
                async with log.timed("sandbox"):
                    if box is None:
                        box = await self.backend.create("python", self.limits)
                    text, result = await run_python(box, args["code"], self.tool_timeout_s)
            except SandboxError as exc:  # not the agent's doing: the episode fails, never trained
                raise sandbox_failed(exc) from exc
            return ToolResult(text, failure="sandbox_timeout" if result.status == "timeout" else None)

        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
        try:
            episode = await self.loop.run(session, messages, run_tool, model=self.model, log=log)
        finally:
            if box is not None:
                await box.close()
        answer = extract_code(episode.answer)
        turns = float(episode.turns)
        if answer is None:
            log.fail("no_answer")
            return Reward(0.0, log.metrics(correct=0.0, tests_passed=0.0, turns=turns))
        try:
            async with log.timed("grade"):
                result = await grade_code(
                    self.backend,
                    task.preamble + "\n\n" + answer if task.preamble else answer,
                    task.tests,
                    limits=self.limits,
                    timeout_s=self.grade_timeout_s,
                    partial_credit=self.partial_credit,
                )
        except SandboxError as exc:  # the grading sandbox failed: not the agent's 0
            raise sandbox_failed(exc) from exc
        if result.reason in ("grader error",):
            log.fail("grader_error")
        return Reward(
            result.reward,
            log.metrics(
                correct=float(result.reason == "passed"),
                tests_passed=result.passed / result.total if result.total else 0.0,
                turns=turns,
            ),
        )
