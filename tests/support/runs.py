"""What the `palaestra train` tests on Ray share: the two-turn environment the rollout actors load
by import path (`TWO_TURN`), the CI-sized run config (`make_config`; `make_episode_config`, its
variant for one group of agent episodes) and the process's local Ray
(`local_ray`, used by tests/orchestrator/conftest.py's `ray_local`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path
from typing import Any

from palaestra.config import load_config
from palaestra.sdk import Environment, Task

REPO_ROOT = str(Path(__file__).resolve().parents[2])
TWO_TURN = "tests.support.runs:TwoTurnEnv"  # importable by Ray's workers: REPO_ROOT is on their path


class TwoTurnEnv(Environment):
    """Two turns per session with a pause between them (loaded by the rollout actor by import path).

    Turn 1 stops at the first "e" (finish reason `stop`, so turn 2 is bridged onto its exact tokens
    rather than forked as after `max_tokens`). The reward is the parity of the reply's length, so
    groups have reward variance. Both calls sample as the run says (`session.sampling`).

    `gate` (a directory) and `gated` (task indices) hold the sessions of those tasks between their
    turns: after turn 1 and the pause each writes `arrived-<index>-<session>` into `gate` and waits
    until `open-<index>` exists there (tests/orchestrator/test_faults.py kills a process while they wait, so the
    kill lands mid-episode whatever the machine's speed). A gate never opened fails the session
    after `gate_timeout_s`, saying so."""

    name = "two-turn"

    def __init__(
        self,
        pause_s: float = 1.0,
        max_tokens: int = 8,
        gate: str | None = None,
        gated: tuple[int, ...] = (),
        gate_timeout_s: float = 600.0,
    ):
        self.pause_s, self.max_tokens = pause_s, max_tokens
        self.gate, self.gated, self.gate_timeout_s = gate, {int(i) for i in gated}, gate_timeout_s

    async def _wait_at_gate(self, session, task) -> None:
        index = int(str(task.task_id).rsplit("-", 1)[1])  # task ids are count-<seed>-<index>
        if self.gate is None or index not in self.gated:
            return
        gate = Path(self.gate)
        (gate / f"arrived-{index}-{session.session_id}").touch()
        deadline = asyncio.get_running_loop().time() + self.gate_timeout_s
        while not (gate / f"open-{index}").exists():
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"TwoTurnEnv: {gate}/open-{index} never appeared ({self.gate_timeout_s} s)"
                )
            await asyncio.sleep(0.05)

    def tasks(self, seed: int):
        return (Task(task_id=f"count-{seed}-{i}") for i in itertools.count())

    async def rollout(self, session, task) -> float:
        messages = [{"role": "user", "content": f"Count, task {task.task_id}: one"}]
        first = await session.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=16,
            stop=["e"],
            **session.sampling,
        )
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
        await asyncio.sleep(self.pause_s)
        await self._wait_at_gate(session, task)
        messages += [{"role": "user", "content": "two"}]
        second = await session.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=self.max_tokens, **session.sampling
        )
        return float(len(second.choices[0].message.content or "") % 2)


def make_config(out: Path, mode: str, *extra: str):
    return load_config(
        None,
        [
            "model.student=tiny",
            "engines.count=2",
            "engines.engine={num_threads: 1}",
            "router={health_check_interval_secs: 2}",
            "env.name=math",
            "env.args={difficulty: 1, max_tokens: 12}",
            "env.tasks_per_step=2",
            "env.samples_per_task=2",
            "env.concurrency=8",
            "env.eval_tasks=2",
            "trainer.megatron_optimizer={lr: 1.0e-4}",
            "trainer.max_tokens_per_microbatch=2048",
            f"run.mode={mode}",
            "run.steps=2",
            "run.checkpoint_every=1",
            "run.step_timeout_s=120",
            f"run.output_dir={out}",
            "logging.tensorboard_dir=null",
            *extra,
        ],
    )


def make_episode_config(out: Path, env: str, args: dict[str, Any], *extra: str):
    """`make_config` for one sync step on one group of two agent episodes (the harness and harbor
    train tests): one engine, environment `env` with `args`, no evaluation, the group trained
    whatever its rewards (a random model's episodes all score 0)."""
    return make_config(
        out,
        "sync",
        "engines.count=1",
        f"env.name={env}",
        f"env.args={json.dumps(args)}",
        "env.tasks_per_step=1",
        "env.samples_per_task=2",
        "env.concurrency=2",
        "env.eval_tasks=0",
        "env.filter_zero_variance_groups=false",
        "run.steps=1",
        *extra,
    )


def local_ray() -> bool:
    """Starts the one local Ray of this process (unless one runs) whose workers can import this
    repository's tests (`TWO_TURN`) and run at normal priority; True if this call started it. It
    is left running: tests/orchestrator/conftest.py shares it between modules and stops it."""
    from palaestra.orchestrator.cluster import init_ray

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_worker_niceness")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [REPO_ROOT, saved["PYTHONPATH"]] if p)
    # Ray starts its workers (the engines, gateway and trainer here) at nice 15: beside other tests
    # in parallel (`make test -n 2`) or other work on the machine they would get almost no CPU.
    os.environ["RAY_worker_niceness"] = "0"
    try:  # Ray's processes take the environment they start with; other tests get theirs back
        return init_ray("127.0.0.1", num_cpus=8)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
