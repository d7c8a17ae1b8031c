"""The harness environment: a real coding agent (Claude Code, Codex, OpenCode, mini-swe-agent, or our
Terminus-style `terminus`) fixes a SWE task in a sandbox.

    palaestra rollout --env harness --env-args '{"harness": "claude-code", "backend": "local"}' --tasks 2

Tasks, the task's sandbox and grading are the swe environment's: both compose a `SweWorkspace`
(environments/swe_agent/workspace.py: the generated set or a SWE-bench-style JSONL, the instance's
environment at /venv, hidden tests run on the agent's diff in a fresh sandbox). Only the agent
differs: instead of `ToolLoop`, the harness binary runs unchanged, headless, in the task's sandbox.

One episode:
1. the episode's run directory on the host: `SessionTunnel`'s unix socket (this session's
   `/s/<id>/v1/` routes, nothing else, at most `max_turns` model calls) and `forward.py`;
2. a sandbox with the repository in /work/repo, the harness's native binary's folder (`native`:
   no npm launcher, so no node; mini-swe-agent's venv) read-only at /opt/harness/NAME@VERSION, the run directory
   read-only and live at /run/palaestra (the docker backend copies the binary into an image layer
   once, and bind-mounts the run directory) and the instance's environment, when it needs one, at
   /venv (first on the harness's PATH: its shell runs the tests as the grader does). The sandbox
   has no network;
3. one exec: `forward.py` listens on 127.0.0.1:8080 of the sandbox's own network namespace, relays
   to the tunnel's socket, and runs the harness pointed at ``http://127.0.0.1:8080/s/<id>/v1`` with
   the session's token (configure.command), its home in /work/home, told the served model's
   context window (the session's `GET /models`, `max_model_len`) and the output budget per call
   (`max_output_tokens`, default an eighth of the window: `configure.Budget`);
4. the harness ends by itself, or at the time budget (`time_limit_s`: the exec's wall clock), or
   at the turn budget (the tunnel refuses call `max_turns` + 1 and the host creates the stop file:
   `forward.py` kills the harness) — both `failure/harness_timeout`; a non-zero exit is
   `failure/harness_exit`, its exit status in `harness/exit_code` and its last output logged
   under a line saying what happened when the output names it (`exit 1 (max_output_tokens)`:
   `exit_reason`);
5. the repository is taken out of the sandbox, diffed against the base and graded as in swe.

A request the gateway refuses is the gateway's to record (`refused` in GET /sessions/{id}); what the
tunnel refused is `tunnel/refused` (other paths) and `tunnel/over_budget` in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from palaestra.environments.episode import EpisodeLog, sandbox_failed
from palaestra.environments.harness import configure
from palaestra.environments.harness.install import HARNESSES, native, shared_root
from palaestra.environments.harness.tunnel import SessionTunnel
from palaestra.environments.mcp_tools.server import McpServer
from palaestra.environments.swe_agent.instance import SweInstance
from palaestra.environments.swe_agent.repo_env import activate
from palaestra.environments.swe_agent.workspace import SweWorkspace, TaskSandbox
from palaestra.sandbox.base import WORKDIR, ExecResult, Limits, Mount, Sandbox, SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

__all__ = ["HarnessEnv", "exec_harness", "tunnel_metrics"]

log = logging.getLogger(__name__)

FORWARD = Path(__file__).with_name("forward.py")
RUN_DIR = "/run/palaestra"
"""The episode's run directory inside the sandbox (read-only): the tunnel's socket, forward.py, stop."""
HARNESS_DIR = "/opt/harness"
PORT = 8080
"""The loopback port of the sandbox's own network namespace that forward.py relays to the tunnel."""
HARNESS_TEMPERATURE = 1.0
"""What the harnesses sample at: neither sends a temperature, and both APIs' default is 1."""
PROMPT = (
    "{problem}\n\nThe repository is your working directory. Fix the bug in the library, not in the "
    "tests; run the tests with `{test_cmd}` to check. Stop when the fix is done."
)
OUTPUT_TAIL = 2000
EXIT_REASONS = (
    ("max_output_tokens", "max_output_tokens"),  # Codex: a reply cut at its output budget
    ("context_length_exceeded", "context_length_exceeded"),
    ("maximum context length", "context_length_exceeded"),
    ("max_tokens", "max_tokens"),  # Claude Code: the same, in Anthropic's words
    ("Reached max turns", "max_turns"),
)
"""(text in a harness's last output, what it means), first match wins: `exit_reason`."""


def exit_reason(output: str) -> str | None:
    """What a harness that exited non-zero said it stopped on, from its last output; None: unknown."""
    return next((reason for text, reason in EXIT_REASONS if text in output), None)


class HarnessEnv(Environment):
    name = "harness"
    temperature = HARNESS_TEMPERATURE
    """What a harness asks for (its API's default); its calls sample at the session's temperature,
    which the gateway applies over it."""

    def __init__(
        self,
        harness: str = "claude-code",
        data: str | None = None,
        backend: Any = "local",
        max_turns: int = 30,
        time_limit_s: float = 900.0,
        memory_mb: int = 4096,
        cache_dir: str | None = None,
        generate_seed: int = 0,
        env_cache_dir: str | None = None,
        find_links: list[str] | None = None,
        index: bool = True,
        mcp_servers: Sequence[McpServer | Mapping[str, Any]] = (),
        max_output_tokens: int | None = None,
    ):
        """`harness` NAME or NAME@VERSION (`palaestra harness install` it first; `terminus`, ours,
        needs no install); `data` a
        SWE-bench-style JSONL (default: swe's generated set); `backend` a sandbox spec or a
        `Backend` that can mount (local, docker); `max_turns` the harness's model calls per episode;
        `time_limit_s` its wall clock; `memory_mb` the sandbox's memory (and address space, unless
        the harness's runtime reserves more: `Harness.address_space`). `cache_dir`, `generate_seed`,
        `env_cache_dir`, `find_links` and `index` are swe's (`SweAgentEnv`): the tasks and how their environments are built.
        `mcp_servers` (`McpServer`s or their fields) are given to the harness through its own MCP
        settings; their `files` are uploaded to the work directory first. `max_output_tokens` the
        output budget per call the harness is told (default: an eighth of the served model's
        context window, `configure.default_output_tokens`; on a CPU, docs/harnesses.md)."""
        name = harness.partition("@")[0]
        if name not in HARNESSES:
            raise ValueError(f"unknown harness {harness!r}: one of {', '.join(sorted(HARNESSES))}")
        if max_turns < 1 or not time_limit_s > 0:
            raise ValueError(f"max_turns and time_limit_s must be positive; got {max_turns}, {time_limit_s}")
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive; got {max_output_tokens}")
        self.max_output_tokens = max_output_tokens
        self.workspace = SweWorkspace.from_args(
            data, backend, cache_dir, generate_seed, env_cache_dir, find_links, index
        )
        self.harness, self.harness_name = harness, name
        self.max_turns, self.time_limit_s = max_turns, float(time_limit_s)
        self.box_limits = Limits(
            timeout_s=self.time_limit_s,
            cpu_s=max(60, int(self.time_limit_s)),
            memory_mb=memory_mb,
            address_space_mb=HARNESSES[name].address_space(memory_mb),
            pids=512,
            workdir_mb=512,
            output_bytes=4 << 20,
        )
        self._root: Path | None = None
        self.mcp_servers = tuple(s if isinstance(s, McpServer) else McpServer(**s) for s in mcp_servers)
        configure.mcp_settings(name, self.mcp_servers)  # a harness without MCP settings refuses them now

    def tasks(self, seed: int) -> list[SweInstance]:
        return self.workspace.tasks(seed)

    def _install(self) -> tuple[Mount, str]:
        """(the mount of the native binary's folder, from an install every user can enter; the
        binary's path in the sandbox)."""
        if self._root is None:
            self._root = shared_root(self.harness)
        folder, binary = native(self._root, self.harness_name)
        inside = f"{HARNESS_DIR}/{self._root.name}"
        return Mount(str(folder), inside), f"{inside}/{binary}"

    async def start(self, task: SweInstance, run_dir: str, episode: EpisodeLog) -> tuple[TaskSandbox, str]:
        """The harness's sandbox for `task` (the workspace's, with the harness's binary and the run
        directory `run_dir` mounted); returns it and the binary's path in it."""
        harness_mount, binary = await asyncio.to_thread(self._install)
        mounts = (harness_mount, Mount(run_dir, RUN_DIR, live=True))
        return await self.workspace.start(task, self.box_limits, episode, mounts), binary

    def config(
        self,
        box: TaskSandbox,
        binary: str,
        session_id: str,
        api_key: str,
        budget: configure.Budget | None = None,
    ) -> dict[str, Any]:
        """What forward.py reads on its stdin: the tunnel's socket, its port, the stop file, and
        the harness's command, environment (the instance's environment first on PATH, when it has
        one) and working directory, for session `session_id` with its token `api_key`, told the
        model's `budget`."""
        env, argv = configure.command(
            self.harness_name,
            binary,
            f"http://127.0.0.1:{PORT}/s/{session_id}/v1",
            api_key,
            self.model,
            PROMPT.format(problem=box.task.problem_statement, test_cmd=box.task.test_cmd),
            self.mcp_servers,
            budget,
        )
        if box.has_env:
            env = activate(env)
        return {
            "socket": f"{RUN_DIR}/tunnel.sock",
            "port": PORT,
            "stop": f"{RUN_DIR}/stop",
            "argv": argv,
            "env": env,
            "cwd": f"{WORKDIR}/repo",
            "mkdirs": [env[k] for k in configure.HOME_DIRS if k in env],
        }

    async def rollout(self, session: Session, task: SweInstance) -> Reward:
        # Whatever temperature the harness sends (none: its API's default, 1), the gateway samples its
        # calls at the session's (gateway/sessions/sampling.py): greedy in `palaestra eval`, the
        # trainer's temperature in a run, so the trainer's logprobs match.
        episode = EpisodeLog()
        gateway_url = session.base_url.removesuffix(f"/s/{session.session_id}/v1")
        metrics: dict[str, float] = {}
        with tempfile.TemporaryDirectory(prefix="palaestra-harness-") as run_dir:
            os.chmod(run_dir, 0o755)  # the sandbox's user (uid 65534 under root) reaches the socket
            shutil.copy(FORWARD, Path(run_dir) / "forward.py")
            tunnel = SessionTunnel(
                gateway_url, session.session_id, str(Path(run_dir) / "tunnel.sock"), self.max_turns
            )
            await tunnel.start()
            try:
                box, binary = await self.start(task, run_dir, episode)
                try:
                    async with box:
                        await self._run(box, session, binary, run_dir, tunnel, episode, metrics)
                        agent_tree = await box.take_out()
                except SandboxError as exc:  # not the agent's doing: failed, never trained
                    raise sandbox_failed(exc) from exc
            finally:
                await tunnel.stop()
        metrics |= tunnel_metrics(tunnel)
        return await self.workspace.grade(task, box.base, agent_tree, episode, **metrics)

    async def _run(
        self,
        box: TaskSandbox,
        session: Session,
        binary: str,
        run_dir: str,
        tunnel: SessionTunnel,
        episode: EpisodeLog,
        metrics: dict[str, float],
    ) -> None:
        """Runs the harness in `box` on its task, to its end or its budget."""
        budget = configure.Budget.of(await self.context_window(session), self.max_output_tokens)
        config = self.config(box, binary, session.session_id, session.api_key, budget)
        for server in self.mcp_servers:  # the harness starts them itself, in this sandbox
            for path, text in server.files.items():
                await box.sandbox.upload(path, text)
        async with episode.timed("model"):  # the harness's run: its model calls and its tools
            result = await self._exec_harness(box, config, run_dir, tunnel)
        stopped = tunnel.spent.is_set()
        metrics["harness/exit_code"] = float(result.exit_code if result.exit_code is not None else -1)
        if stopped or result.status == "timeout":
            episode.fail("harness_timeout")
        elif not result.ok:
            episode.fail("harness_exit")
            tail = (result.stdout + "\n" + result.stderr).strip()[-OUTPUT_TAIL:]
            reason = exit_reason(tail)
            what = f"exit {result.exit_code}" + (f" ({reason})" if reason else "")
            if result.status != "ok":  # the exec itself went wrong (killed, out of memory, ...)
                what = f"{result.status}, {what}"
            log.warning(
                "harness %s in session %s: %s%s; last output:\n%s",
                self.harness,
                session.session_id,
                what,
                f" {result.detail}" if result.detail else "",
                tail,
            )

    @staticmethod
    async def context_window(session: Session) -> int:
        """The served model's context window: `max_model_len` of the session's `GET /models`."""
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            r = await client.get(
                f"{session.base_url}/models", headers={"Authorization": f"Bearer {session.api_key}"}
            )
            r.raise_for_status()
            return int(r.json()["data"][0]["max_model_len"])

    async def _exec_harness(
        self, box: TaskSandbox, config: dict[str, Any], run_dir: str, tunnel: SessionTunnel
    ) -> ExecResult:
        return await exec_harness(box.sandbox, config, run_dir, tunnel)


async def exec_harness(
    sandbox: Sandbox, config: dict[str, Any], run_dir: str, tunnel: SessionTunnel
) -> ExecResult:
    """forward.py + the harness (`config`: what forward.py reads) as one exec in `sandbox`; stopped
    through the stop file when the tunnel's turn budget is spent (the exec's own timeout is the
    time budget). The harbor environment runs its harness agents through it too."""
    run = asyncio.ensure_future(
        sandbox.exec(["python3", "-I", "-S", f"{RUN_DIR}/forward.py"], stdin=json.dumps(config))
    )
    spent = asyncio.ensure_future(tunnel.spent.wait())
    try:
        await asyncio.wait({run, spent}, return_when=asyncio.FIRST_COMPLETED)
        if spent.done() and not run.done():
            (Path(run_dir) / "stop").touch()
        return await run
    finally:
        spent.cancel()
        if not run.done():
            run.cancel()
            with contextlib.suppress(BaseException):
                await run


def tunnel_metrics(tunnel: SessionTunnel) -> dict[str, float]:
    return {
        "harness/calls": float(tunnel.calls),
        "tunnel/refused": float(sum(tunnel.refused.values())),
        "tunnel/over_budget": float(tunnel.over_budget),
    }
