"""The swe_agent environment: fix a bug in a repository with the tools ``bash``, ``read_file``,
``str_replace``, ``write_file`` and ``submit`` (OpenAI tools), inside a sandbox that holds the
repository; graded by applying the agent's diff to a fresh copy in a fresh sandbox and running
FAIL_TO_PASS and PASS_TO_PASS (`grading.py`). Reward 1 only if both pass. The turns are
`environments/episode.py`'s `ToolLoop`: a reply without a tool call is answered with a nudge to use
the tools, and only ``submit`` (or ``max_turns``) ends the episode.

    palaestra rollout --env swe --env-args '{"data": "swe.jsonl", "backend": "local"}' --tasks 4

Tasks: a SWE-bench-style JSONL (`instance.py`; `palaestra swe generate` writes one from the bundled
repositories), or, without ``data``, the generated set, made once into
``~/.cache/palaestra/swe/`` (or ``cache_dir``). Each instance is validated (`grading.validate`)
before its first episode; an invalid one fails the episode with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from pathlib import Path
from typing import Any

from palaestra.environments.episode import EpisodeLog, ToolLoop, ToolResult, resolve_backend
from palaestra.environments.swe_agent.grading import grade, validate
from palaestra.environments.swe_agent.instance import SweInstance, load_jsonl
from palaestra.environments.swe_agent.repo_env import EnvOptions, instance_env, venv_mount
from palaestra.environments.swe_agent.snapshot import agent_copy_tar, diff_snapshots, unpack_tar
from palaestra.environments.swe_agent.testrun import upload_tree
from palaestra.environments.swe_agent.tools import TOOLS, call_tool, download_repo
from palaestra.sandbox.base import Limits, Sandbox, SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

SYSTEM = (
    "You are a software engineer fixing a bug in a Python repository. The repository is your working "
    "directory. Use the tools to read the code, reproduce the problem, edit files and run the tests "
    "({test_cmd}). Change the library, not the tests. When you are done, call submit."
)
UNPARSED_CALL = "error: your tool call could not be parsed; write it in the tool-call format"
KEEP_GOING = "Use the tools to work on the repository; call submit when you are done."
GENERATOR_VERSION = "v2"  # v2: mutants judged by the tests that pass on the original, 20 s CPU each


class SweAgentEnv(Environment):
    name = "swe"

    def __init__(
        self,
        data: str | None = None,
        backend: Any = "local",
        max_turns: int = 20,
        max_tokens: int = 1024,
        temperature: float = 1.0,
        tool_timeout_s: float = 30.0,
        cache_dir: str | None = None,
        generate_seed: int = 0,
        env_cache_dir: str | None = None,
        find_links: list[str] | None = None,
        index: bool = True,
    ):
        """`data` a SWE-bench-style JSONL (default: the generated set); `backend` a sandbox spec or
        a `Backend`; `max_turns` model calls per episode. Instances that need an environment of
        their own (`repo_env.py`) get one built in `env_cache_dir` (default
        ``~/.cache/palaestra/swe/envs``) by pip, from the package index unless `index` is false,
        and from the `find_links` directories."""
        self.loop = ToolLoop(TOOLS, max_turns, max_tokens, temperature, UNPARSED_CALL, KEEP_GOING)
        self.data, self.backend = data, resolve_backend(backend)
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature
        self.tool_timeout_s = tool_timeout_s
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "palaestra" / "swe")
        self.generate_seed = generate_seed
        self.env_options = EnvOptions(env_cache_dir, tuple(find_links or ()), index)
        self.limits = Limits(timeout_s=tool_timeout_s, cpu_s=int(tool_timeout_s), memory_mb=1024, pids=128)
        self._instances: list[SweInstance] | None = None
        self._validated: dict[str, asyncio.Future] = {}

    def instances(self) -> list[SweInstance]:
        if self._instances is None:
            path = Path(self.data) if self.data else self._generated()
            self._instances = load_jsonl(path)
        return self._instances

    def _generated(self) -> Path:
        """The generated set, made once (it runs the bundled repos' tests in sandboxes: ~a minute)."""
        from palaestra.environments.swe_agent.generate import generate

        path = self.cache_dir / f"generated-{GENERATOR_VERSION}-seed{self.generate_seed}" / "swe.jsonl"
        if not path.exists():  # generate() writes the JSONL last: a run cut short leaves none
            path.parent.mkdir(parents=True, exist_ok=True)
            job = generate(path, self.backend, seed=self.generate_seed)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # works inside a running event loop too
                pool.submit(asyncio.run, job).result()
        return path

    def tasks(self, seed: int) -> list[SweInstance]:
        tasks = list(self.instances())
        random.Random(seed).shuffle(tasks)
        return tasks

    async def _check(self, instance: SweInstance) -> None:
        """Validates an instance once per environment; raises ValueError with the reason."""
        future = self._validated.get(instance.instance_id)
        if future is None:
            future = self._validated[instance.instance_id] = asyncio.ensure_future(
                validate(instance, self.backend, env_options=self.env_options)
            )
        result = await future
        if not result.valid:
            raise ValueError(f"instance {instance.instance_id} is invalid: {result.reason}")

    async def rollout(self, session: Session, task: SweInstance) -> Reward:
        await self._check(task)
        log = EpisodeLog()
        base = await asyncio.to_thread(task.base)  # git archive: off the event loop
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM.format(test_cmd=task.test_cmd)},
            {"role": "user", "content": task.problem_statement},
        ]
        submitted = False

        async def run_tool(name: str, args: dict[str, Any]) -> ToolResult:
            nonlocal submitted
            async with log.timed("sandbox"):
                text, result = await call_tool(box, name, args, self.tool_timeout_s)
            submitted = submitted or name == "submit"
            timed_out = result is not None and result.status == "timeout"
            return ToolResult(text, "sandbox_timeout" if timed_out else None, ends_episode=name == "submit")

        venv = await instance_env(task, base, self.env_options)  # built by the validation above
        async with log.timed("sandbox"):
            box: Sandbox = await self.backend.create(
                "python", self.limits, mounts=(venv_mount(venv),) if venv else ()
            )
        try:
            async with log.timed("sandbox"):
                unpacked = await upload_tree(box, await asyncio.to_thread(agent_copy_tar, base))
            if not unpacked.ok:
                raise SandboxError(f"could not unpack the repository: {unpacked.stderr[-300:]}")
            await self.loop.run(session, messages, run_tool, model=self.model, log=log)
            async with log.timed("sandbox"):
                agent_tree = unpack_tar(await download_repo(box))
        except SandboxError:
            log.fail("sandbox_error")
            return Reward(0.0, log.metrics(resolved=0.0, submitted=float(submitted)))
        finally:
            await box.close()
        model_patch = diff_snapshots(base, agent_tree)
        try:
            async with log.timed("grade"):
                result = await grade(task, model_patch, self.backend, base, env_options=self.env_options)
        except (SandboxError, RuntimeError):
            log.fail("grader_error")
            return Reward(0.0, log.metrics(resolved=0.0, submitted=float(submitted)))
        if result.reason.startswith("tests_did_not_finish"):
            log.fail("sandbox_timeout")
        elif result.reason.startswith("test_command_failed"):  # the tests could not start: not the agent's
            log.fail("grader_error")
        return Reward(
            result.reward,
            log.metrics(
                resolved=result.reward,
                submitted=float(submitted),
                f2p_passed=result.f2p_passed / max(len(result.fail_to_pass), 1),
                p2p_passed=result.p2p_passed / max(len(result.pass_to_pass), 1),
                patch_applies=float(not result.reason.startswith("patch_does_not_apply")),
                patch_lines=float(model_patch.count("\n")),
            ),
        )
