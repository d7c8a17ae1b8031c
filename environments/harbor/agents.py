"""Who attempts a Harbor task: a CLI harness, a plain tool loop, the oracle, or nobody.

    agent = make_agent("claude-code", AgentOptions(max_turns=20))   # any name in HARNESSES
    async with agent.attempt(session, log, metrics) as attempt:     # mounts it needs, per episode
        async with Trial.open(task, built, backend, attempt.mounts) as trial:
            await attempt.run(trial)

Names: every harness `palaestra harness install` knows (environments/harness/install.py's
``HARNESSES``: Claude Code, Codex, and any added there with its `configure.command` — nothing here
names them), ``openai-tools`` (the OpenAI SDK's chat completions with one ``bash`` tool,
`ToolLoop`), and two that call no model, for `palaestra harbor validate` and tests: ``oracle``
(runs the task's solution/solve.sh; a SCRIPTED agent, labelled as such wherever it proves a
reward) and ``none`` (the empty attempt).

A harness runs as in the harness environment (environments/harness/env.py): its native binary
read-only at /opt/harness, the episode's run directory (the session tunnel's socket, forward.py)
at /run/palaestra, the tunnel the sandbox's only way out and its turn budget; the instruction is
its prompt and the task's WORKDIR its working directory, the Dockerfile's ENV in its environment;
it is told the served model's context window and an output budget per call (`configure.Budget`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.environments.episode import EpisodeLog, ToolLoop, ToolResult, format_exec
from palaestra.environments.harbor.trial import Trial
from palaestra.environments.harness import configure
from palaestra.environments.harness.env import (
    FORWARD,
    HARNESS_DIR,
    HARNESS_TEMPERATURE,
    PORT,
    RUN_DIR,
    HarnessEnv,
    exec_harness,
    tunnel_metrics,
)
from palaestra.environments.harness.install import HARNESSES, native, shared_root
from palaestra.environments.harness.tunnel import SessionTunnel
from palaestra.sandbox.base import Mount

__all__ = ["BUILTIN_AGENTS", "Agent", "AgentOptions", "Attempt", "agent_names", "make_agent"]

log = logging.getLogger(__name__)

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the task's working directory; returns its exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command."}},
            "required": ["command"],
        },
    },
}
SYSTEM = (
    "You are an agent in a Linux shell, working on the task the user gives. Use the bash tool to look "
    "around, edit files and check your work. When the task is done, answer without a tool call."
)
UNPARSED_CALL = "error: your tool call could not be parsed; write it in the tool-call format"
OUTPUT_TAIL = 2000


@dataclass(frozen=True)
class AgentOptions:
    max_turns: int = 20
    """Model calls per episode (a harness's tunnel budget, the tool loop's turns)."""
    max_tokens: int = 1024
    """Tokens per model call (openai-tools; a harness asks for its own)."""
    tool_timeout_s: float = 60.0
    """Wall clock of one bash call (openai-tools); a harness's whole run has [agent].timeout_sec."""
    max_output_tokens: int | None = None
    """The output budget per call a harness is told (`configure.Budget`, with the served model's
    context window); None: an eighth of the window, as in the harness environment."""


@dataclass
class Attempt:
    """One episode's agent: the mounts its sandbox needs and how it works in the trial."""

    run: Callable[[Trial], Awaitable[None]]
    mounts: tuple[Mount, ...] = ()
    address_space_mb: int | None = None
    """The address space its sandbox must allow beyond the task's memory (`Harness.address_space_mb`)."""


class Agent(abc.ABC):
    name: str
    calls_model = True
    """False for the scripted agents (oracle, none): they need no session."""
    temperature: float | None = None
    """The temperature its episodes sample at when the agent fixes it (a harness's own)."""

    @abc.abstractmethod
    def attempt(
        self, session: Any, model: str, log: EpisodeLog, metrics: dict[str, float]
    ) -> contextlib.AbstractAsyncContextManager[Attempt]:
        """One episode's attempt on `session` (None for an agent that calls no model); metrics it
        records go into `metrics`."""


class NoAgent(Agent):
    """The empty attempt: the verifier grades the starting state."""

    name, calls_model = "none", False

    @contextlib.asynccontextmanager
    async def attempt(self, session, model, log, metrics) -> AsyncIterator[Attempt]:
        async def run(trial: Trial) -> None:
            return None

        yield Attempt(run)


class Oracle(Agent):
    """SCRIPTED: runs the task's solution/solve.sh (at /solution) with ``[solution].env``."""

    name, calls_model = "oracle", False

    @contextlib.asynccontextmanager
    async def attempt(self, session, model, log, metrics) -> AsyncIterator[Attempt]:
        async def run(trial: Trial) -> None:
            if not trial.task.has_solution:
                raise ValueError(f"harbor task {trial.task.task_id} has no solution/solve.sh for the oracle")
            await trial.put_solution()
            async with log.timed("sandbox"):
                result = await trial.exec("bash /solution/solve.sh", env=trial.task.solution_env)
            metrics["oracle/exit_code"] = float(result.exit_code if result.exit_code is not None else -1)
            if result.status == "timeout":
                log.fail("sandbox_timeout")

        yield Attempt(run)


class BashLoop(Agent):
    """The OpenAI SDK's chat completions with one bash tool (`ToolLoop`): a reply without a tool
    call ends the episode."""

    name = "openai-tools"

    def __init__(self, options: AgentOptions):
        self.options = options
        self.loop = ToolLoop([BASH_TOOL], options.max_turns, options.max_tokens, None, UNPARSED_CALL)

    @contextlib.asynccontextmanager
    async def attempt(self, session, model, log, metrics) -> AsyncIterator[Attempt]:
        async def run(trial: Trial) -> None:
            async def bash(name: str, args: dict[str, Any]) -> ToolResult:
                async with log.timed("sandbox"):
                    result = await trial.exec(args["command"], timeout=self.options.tool_timeout_s)
                return ToolResult(
                    format_exec(result), "sandbox_timeout" if result.status == "timeout" else None
                )

            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": trial.task.instruction},
            ]
            budget = trial.task.agent_timeout_s  # [agent].timeout_sec bounds the whole loop
            try:
                await asyncio.wait_for(self.loop.run(session, messages, bash, model=model, log=log), budget)
            except TimeoutError:
                log.fail("harness_timeout")

        yield Attempt(run)


class HarnessAgent(Agent):
    """A CLI harness (module docstring), unchanged, in the task's sandbox."""

    temperature = HARNESS_TEMPERATURE

    def __init__(self, spec: str, options: AgentOptions):
        self.spec, self.name = spec, spec.partition("@")[0]
        self.options = options
        self._root: Path | None = None

    def _install(self) -> tuple[Mount, str]:
        if self._root is None:
            self._root = shared_root(self.spec)
        folder, binary = native(self._root, self.name)
        inside = f"{HARNESS_DIR}/{self._root.name}"
        return Mount(str(folder), inside), f"{inside}/{binary}"

    @contextlib.asynccontextmanager
    async def attempt(self, session, model, log, metrics) -> AsyncIterator[Attempt]:
        harness_mount, binary = await asyncio.to_thread(self._install)
        gateway_url = session.base_url.removesuffix(f"/s/{session.session_id}/v1")
        with tempfile.TemporaryDirectory(prefix="palaestra-harbor-harness-") as run_dir:
            os.chmod(run_dir, 0o755)  # the sandbox's user reaches the socket
            shutil.copy(FORWARD, Path(run_dir) / "forward.py")
            tunnel = SessionTunnel(
                gateway_url, session.session_id, f"{run_dir}/tunnel.sock", self.options.max_turns
            )
            await tunnel.start()

            async def run(trial: Trial) -> None:
                window = await HarnessEnv.context_window(session)
                env, argv = configure.command(
                    self.name,
                    binary,
                    f"http://127.0.0.1:{PORT}/s/{session.session_id}/v1",
                    session.api_key,
                    model,
                    trial.task.instruction,
                    budget=configure.Budget.of(window, self.options.max_output_tokens),
                )
                env = {**trial.built.env, **trial.task.env, **env}
                config = {
                    "socket": f"{RUN_DIR}/tunnel.sock",
                    "port": PORT,
                    "stop": f"{RUN_DIR}/stop",
                    "argv": argv,
                    "env": env,
                    "cwd": trial.built.workdir,
                    "mkdirs": [env[k] for k in configure.HOME_DIRS if k in env],
                }
                async with log.timed("model"):
                    result = await exec_harness(trial.sandbox, config, run_dir, tunnel)
                metrics["harness/exit_code"] = float(result.exit_code if result.exit_code is not None else -1)
                if tunnel.spent.is_set() or result.status == "timeout":
                    log.fail("harness_timeout")
                elif not result.ok:
                    log.fail("harness_exit")
                    tail = (result.stdout + "\n" + result.stderr).strip()[-OUTPUT_TAIL:]
                    log_harness_exit(self.spec, session.session_id, result, tail)

            try:
                mounts = (harness_mount, Mount(run_dir, RUN_DIR, live=True))
                yield Attempt(run, mounts, HARNESSES[self.name].address_space_mb)
            finally:
                await tunnel.stop()
                metrics.update(tunnel_metrics(tunnel))


def log_harness_exit(spec: str, session_id: str, result: Any, tail: str) -> None:
    log.warning(
        "harness %s in session %s: %s, exit %s %s; last output:\n%s",
        spec,
        session_id,
        result.status,
        result.exit_code,
        result.detail,
        tail,
    )


BUILTIN_AGENTS: dict[str, Callable[[AgentOptions], Agent]] = {
    "openai-tools": BashLoop,
    "oracle": lambda options: Oracle(),
    "none": lambda options: NoAgent(),
}


def agent_names() -> str:
    return ", ".join([*sorted(HARNESSES), *BUILTIN_AGENTS])


def make_agent(spec: str, options: AgentOptions | None = None) -> Agent:
    """The agent `spec` names: a harness NAME or NAME@VERSION, or one of `BUILTIN_AGENTS`."""
    options = options or AgentOptions()
    if spec in BUILTIN_AGENTS:
        return BUILTIN_AGENTS[spec](options)
    if spec.partition("@")[0] in HARNESSES:
        return HarnessAgent(spec, options)
    raise ValueError(f"unknown agent {spec!r}: one of {agent_names()}")
