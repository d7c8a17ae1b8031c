"""The math environment: an ordinary openai-client agent plus the math verifier.

Two variants:
* `MathEnv` ("math"): one turn, the answer goes in `\\boxed{}`;
* `MathToolEnv` ("math-tool"): the model may call a `calculator` tool (OpenAI tools) for up to
  `max_turns` turns; the environment evaluates each call safely (`calculator.py`, no eval). The
  turns are `environments/episode.py`'s `ToolLoop`: a malformed call is answered with the error and
  counted (``failure/tool_call_parse``), and a conversation that outgrows the context is graded as
  it stands (``failure/context_exceeded``).

Tasks come from the seeded generator (`tasks.py`) or, with `data=PATH`, from a GSM8K-format JSONL.
An answer the verifier cannot read as math scores 0 and is counted (``failure/unparseable_answer``).
Sampling settings (temperature, the episode's seed) are the run's: every call passes
`**session.sampling`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from palaestra.environments.episode import EpisodeLog, ToolLoop
from palaestra.environments.math.calculator import CALCULATOR_TOOL, calculate
from palaestra.environments.math.tasks import (
    KINDS,
    MathTask,
    generate_task,
    iter_tasks,
    load_gsm8k_jsonl,
)
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session
from palaestra.verifiers.math import averify_math

SYSTEM = "Solve the problem. Put the final answer in \\boxed{}."
TOOL_SYSTEM = "Solve the problem. Use the calculator tool for arithmetic. Put the final answer in \\boxed{}."


class MathEnv(Environment):
    name = "math"

    def __init__(
        self,
        difficulty: int = 1,
        data: str | None = None,
        max_tokens: int = 256,
        kinds: Sequence[str] = KINDS,
    ):
        """`difficulty` 0-5 and `kinds` (arithmetic, word_problem, fraction; cycled) choose the
        generated tasks; `data` (a GSM8K-format JSONL) replaces them."""
        self.difficulty, self.data, self.task_kinds = difficulty, data, tuple(kinds)
        self.max_tokens = max_tokens
        if not data:  # a bad difficulty or kind fails here, clearly, not in the middle of a run
            if not self.task_kinds:
                raise ValueError("kinds must not be empty")
            for kind in self.task_kinds:
                generate_task(0, 0, difficulty, kind)

    def kinds(self) -> list[str] | None:
        return None if self.data else list(self.task_kinds)

    def tasks(self, seed: int) -> Iterable[MathTask]:
        return (
            load_gsm8k_jsonl(self.data) if self.data else iter_tasks(seed, self.difficulty, self.task_kinds)
        )

    async def rollout(self, session: Session, task: MathTask) -> Reward:
        reply = await session.client.chat.completions.create(
            model=self.model,
            max_tokens=self.max_tokens,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}],
            **session.sampling,
        )
        result = await averify_math(reply.choices[0].message.content or "", task.answer)
        return Reward(
            result.reward,
            {
                "correct": float(result.correct),
                "answered": float(result.parsed is not None),
                "failure/unparseable_answer": float(result.reason == "unparseable"),
            },
        )


class MathToolEnv(MathEnv):
    name = "math-tool"

    def __init__(self, max_turns: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.max_turns = max_turns
        self.loop = ToolLoop([CALCULATOR_TOOL], max_turns, self.max_tokens)

    async def rollout(self, session: Session, task: MathTask) -> Reward:
        log = EpisodeLog()

        async def calculator(name: str, args: dict[str, Any]) -> str:
            return calculate(args["expression"])

        messages = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": task.question}]
        episode = await self.loop.run(session, messages, calculator, model=self.model, log=log)
        if episode.answer is None:
            log.fail("no_answer")
        result = await averify_math(episode.last_reply, task.answer)  # graded as it stands
        return Reward(
            result.reward,
            log.metrics(
                correct=float(result.correct),
                **{"failure/unparseable_answer": float(result.reason == "unparseable")},
            ),
        )
