"""`JudgedMathEnv` (``--env judged-math``): one reply per math task, rewarded by a judge model.

    palaestra rollout --env judged-math --tasks 4 \
        --env-args '{"judge": {"url": "http://127.0.0.1:30001", "tokenizer": "tiny"}}'

The judge (`palaestra.verifiers.judge.Judge`, its fields as `judge`) reads the question, the
reference answer and the reply; its verdict is the reward. ``correct`` (the rule verifier's, for
comparison) and the judge's ``judge/score``, ``judge/failed``, ``judge/time_s`` are the metrics.
``judge: null`` rewards the same episodes with the rule instead (bench/judge_mcp.py's baseline).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from palaestra.environments.math.tasks import MathTask, iter_tasks
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session
from palaestra.verifiers.judge import Judge
from palaestra.verifiers.math import averify_math

SYSTEM = "Solve the problem. Answer with the final number in \\boxed{}."


class JudgedMathEnv(Environment):
    name = "judged-math"

    def __init__(self, judge: Judge | Mapping[str, Any] | None, difficulty: int = 0, max_tokens: int = 128):
        """`judge` a `Judge` or its fields as a dict (JSON `--env-args`); None: the rule's reward."""
        self.judge = judge if judge is None or isinstance(judge, Judge) else Judge(**judge)
        self.difficulty, self.max_tokens = difficulty, max_tokens

    def tasks(self, seed: int) -> Iterable[MathTask]:
        return iter_tasks(seed, self.difficulty, ("arithmetic",))

    async def rollout(self, session: Session, task: MathTask) -> Reward:
        reply = await session.client.chat.completions.create(
            model=self.model,
            max_tokens=self.max_tokens,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}],
            **session.sampling,
        )
        answer = reply.choices[0].message.content or ""
        rule = await averify_math(answer, task.answer)
        unparseable = {"failure/unparseable_answer": float(rule.reason == "unparseable")}
        if self.judge is None:
            return Reward(rule.reward, {"correct": float(rule.correct), **unparseable})
        verdict = await self.judge.verdict(
            session.session_id, question=task.question, answer=answer, reference=task.answer
        )
        return self.judge.reward(verdict, correct=float(rule.correct), **unparseable)
