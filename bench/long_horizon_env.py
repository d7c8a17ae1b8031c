"""The long-horizon workload of `python -m bench.modes --config long_horizon`: episodes of
heavy-tailed length whose turns wait on a tool, the shape of agentic coding rollouts without their
cost on two cores.

A task fixes its episode: the number of turns (1 to `max_turns`, P(turns >= k) = 1/k, so most
episodes are short and one in `max_turns` runs the whole way), for each turn about how many tokens
the model samples (`min_tokens` to `max_tokens`) and how long its tool call waits (log-uniform
between `tool_min_s` and `tool_max_s`). A turn of about n tokens is asked for with a `regex`
constraint of 4n letters (the tiny preset's tokens average ~3.7 letters): the constraint ends the
turn with the end-of-turn token, as a real agent's turn ends, so the next turn bridges onto it and
the episode is one sample (a turn cut at max_tokens makes the gateway fork the session, a new
sample per turn, each repeating the whole history). The
tool is a plain `asyncio.sleep` followed by its output as the next user message: a sandbox round
trip would add its own CPU on the two shared cores and nothing to what is measured, which is
waiting. All of it comes from the task's seed, so every mode runs the same episodes. With
``sandbox`` (a backend spec: local, docker) each episode holds one sandbox and the tool is
``sleep`` run in it instead: the round trips bench/chaos.py kills a sandbox under; a sandbox that
dies fails its episode (``sandbox_error``, environments/episode.py).

The reward is the share of the episode's replies that contain the task's target character, a
signal with variance inside a group (what GRPO needs) and nothing to learn that matters here.

Loaded by import path (`bench.long_horizon_env:LongHorizonEnv`) from the repository root, which is
the working directory of the run and of its Ray workers.
"""

from __future__ import annotations

import asyncio
import math
import random
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass

from palaestra.environments.episode import resolve_backend, sandbox_failed
from palaestra.sandbox.base import Limits, Sandbox, SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

SYSTEM = "You are a coding agent. Run one tool per turn and read its output."
SANDBOX_LIMITS = Limits(timeout_s=30.0, cpu_s=10, memory_mb=256, pids=16)


@dataclass(frozen=True)
class LongTask:
    task_id: str
    tokens: tuple[int, ...]  # sampled tokens per turn; its length is the number of turns
    tool_s: tuple[float, ...]  # the tool's wait after each turn but the last
    target: str


def heavy_tailed_turns(rng: random.Random, max_turns: int) -> int:
    """P(turns >= k) = 1/k for k <= max_turns: half the episodes are one turn, one in ten ten."""
    return min(max_turns, int(1.0 / (1.0 - rng.random())))


class LongHorizonEnv(Environment):
    name = "long-horizon"

    def __init__(
        self,
        max_turns: int = 40,
        min_tokens: int = 20,
        max_tokens: int = 60,
        tool_min_s: float = 0.05,
        tool_max_s: float = 2.0,
        sandbox: str | None = None,
    ):
        """Episodes of 1 to `max_turns` turns (heavy-tailed), each turn `min_tokens` to
        `max_tokens` sampled tokens, each tool call waiting `tool_min_s` to `tool_max_s`, in a
        sandbox of the backend `sandbox` (None: in this process)."""
        if not 1 <= max_turns:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(
                f"min_tokens, max_tokens: need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}"
            )
        if not 0 < tool_min_s <= tool_max_s:
            raise ValueError(f"tool_min_s, tool_max_s: need 0 < min <= max, got {tool_min_s}, {tool_max_s}")
        self.max_turns, self.min_tokens, self.max_tokens = max_turns, min_tokens, max_tokens
        self.tool_min_s, self.tool_max_s = tool_min_s, tool_max_s
        self.backend = None if sandbox is None else resolve_backend(sandbox)

    def task(self, seed: int, index: int) -> LongTask:
        rng = random.Random(f"long-horizon/{seed}/{index}")
        turns = heavy_tailed_turns(rng, self.max_turns)
        lo, hi = math.log(self.tool_min_s), math.log(self.tool_max_s)
        return LongTask(
            task_id=f"lh-{seed}-{index}",
            tokens=tuple(rng.randint(self.min_tokens, self.max_tokens) for _ in range(turns)),
            tool_s=tuple(math.exp(rng.uniform(lo, hi)) for _ in range(turns - 1)),
            target=rng.choice(string.ascii_lowercase),
        )

    def tasks(self, seed: int) -> Iterator[LongTask]:
        index = 0
        while True:
            yield self.task(seed, index)
            index += 1

    async def rollout(self, session: Session, task: LongTask) -> Reward:
        if self.backend is None:
            return await self._episode(session, task, None)
        try:
            box = await self.backend.create("python", SANDBOX_LIMITS)
            try:
                return await self._episode(session, task, box)
            finally:
                await box.close()
        except SandboxError as exc:
            raise sandbox_failed(exc) from exc

    async def _episode(self, session: Session, task: LongTask, box: Sandbox | None) -> Reward:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {task.task_id}."},
        ]
        hits, tool_s, model_s, started = 0, 0.0, 0.0, time.perf_counter()
        for turn, n in enumerate(task.tokens):
            t0 = time.perf_counter()
            reply = await session.client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=4 * n + 8,  # a bound only: the constraint ends the turn
                extra_body={"regex": f"[a-z]{{{4 * n}}}"},
                **session.sampling,
            )
            model_s += time.perf_counter() - t0
            text = reply.choices[0].message.content or ""
            hits += task.target in text
            messages.append({"role": "assistant", "content": text})
            if turn < len(task.tool_s):
                t0 = time.perf_counter()
                if box is None:
                    await asyncio.sleep(task.tool_s[turn])  # the tool runs
                else:
                    await box.exec(["sleep", f"{task.tool_s[turn]:.3f}"])
                tool_s += time.perf_counter() - t0
                messages.append({"role": "user", "content": f"tool output {turn}: exit 0, {len(text)} bytes"})
        return Reward(
            hits / len(task.tokens),
            {
                "turns": float(len(task.tokens)),
                "episode_s": time.perf_counter() - started,
                "model_s": model_s,
                "tool_s": tool_s,
            },
        )
