"""The swe tasks and what every agent on them shares: the instances, a task's sandbox and the grading.
The swe environment (`env.py`: the tool loop) and the harness environment (a real CLI agent) each
compose one `SweWorkspace`; only how the agent works in the sandbox differs between them.

    workspace = SweWorkspace("swe.jsonl", backend, env_options=EnvOptions(find_links=(...,), index=False))
    box = await workspace.start(task, limits, log)          # validated, its environment built
    async with box:                                          # the agent's copy unpacked in repo/
        ...                                                  # the agent works in box.sandbox
        tree = await box.take_out()
    reward = await workspace.grade(task, box.base, tree, log)

Tasks: a SWE-bench-style JSONL (`instance.py`), or without one the generated set, made once into
``cache_dir`` (default ``~/.cache/palaestra/swe/``). Each instance is validated (`grading.validate`)
once, before its first episode; an invalid one fails the episode with the reason.

A task's sandbox holds the agent's history-free copy of the repository in ``repo/`` and, when the
instance needs one, its environment (`repo_env.py`) read-only at ``/venv``: the agent runs the tests
as the grader does.

Grading (`grade`): the agent's tree is diffed against the base and graded by `grading.grade` in a
fresh sandbox. Failures it counts: ``grader_error`` (grading could not run, or the test command
could not start: not the agent's doing) and ``sandbox_timeout`` (the tests did not finish); a
grading sandbox that fails (`SandboxError`) fails the episode (``sandbox_error``, never trained).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.environments.episode import EpisodeLog, sandbox_failed
from palaestra.environments.swe_agent import grading
from palaestra.environments.swe_agent.instance import SweInstance, load_jsonl
from palaestra.environments.swe_agent.repo_env import EnvOptions, instance_env, venv_mount
from palaestra.environments.swe_agent.snapshot import Snapshot, agent_copy_tar, diff_snapshots, unpack_tar
from palaestra.environments.swe_agent.testrun import upload_tree
from palaestra.environments.swe_agent.tools import download_repo
from palaestra.sandbox.base import Backend, Limits, Mount, Sandbox, SandboxError
from palaestra.sdk.environment import Reward

__all__ = ["GENERATOR_VERSION", "SweWorkspace", "TaskSandbox"]

GENERATOR_VERSION = "v2"  # v2: mutants judged by the tests that pass on the original, 20 s CPU each


@dataclass
class TaskSandbox:
    """One episode's sandbox (`SweWorkspace.start`). Entering unpacks the agent's copy of the
    repository in ``repo/`` (a `SandboxError` if it cannot); leaving closes the sandbox."""

    task: SweInstance
    base: Snapshot
    sandbox: Sandbox
    has_env: bool
    """Whether the instance's environment is mounted at ``/venv``."""
    log: EpisodeLog

    async def __aenter__(self) -> TaskSandbox:
        try:
            async with self.log.timed("sandbox"):
                unpacked = await upload_tree(self.sandbox, await asyncio.to_thread(agent_copy_tar, self.base))
            if not unpacked.ok:
                raise SandboxError(f"could not unpack the repository: {unpacked.stderr[-300:]}")
        except BaseException:
            await self.sandbox.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sandbox.close()

    async def take_out(self) -> Snapshot:
        """The repository as the agent left it (without .git)."""
        async with self.log.timed("sandbox"):
            return unpack_tar(await download_repo(self.sandbox))


class SweWorkspace:
    def __init__(
        self,
        data: str | None,
        backend: Backend,
        *,
        cache_dir: str | None = None,
        generate_seed: int = 0,
        env_options: EnvOptions | None = None,
    ):
        """`data` a SWE-bench-style JSONL (None: the generated set, made in `cache_dir` with
        `generate_seed`); `backend` where the sandboxes run; `env_options` how instances'
        environments are built (`repo_env.EnvOptions`)."""
        self.data, self.backend = data, backend
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "palaestra" / "swe")
        self.generate_seed = generate_seed
        self.env_options = env_options or EnvOptions()
        self._instances: list[SweInstance] | None = None
        self._validated: dict[str, asyncio.Future] = {}

    @classmethod
    def from_args(
        cls,
        data: str | None,
        backend: Any,
        cache_dir: str | None,
        generate_seed: int,
        env_cache_dir: str | None,
        find_links: list[str] | None,
        index: bool,
    ) -> SweWorkspace:
        """The workspace of an environment's constructor arguments (swe's and the harness's):
        `backend` a name or a `Backend`, the environment build options spelled out."""
        from palaestra.environments.episode import resolve_backend

        return cls(
            data,
            resolve_backend(backend),
            cache_dir=cache_dir,
            generate_seed=generate_seed,
            env_options=EnvOptions(env_cache_dir, tuple(find_links or ()), index),
        )

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

    async def check(self, instance: SweInstance) -> None:
        """Validates an instance once per workspace; raises ValueError with the reason."""
        future = self._validated.get(instance.instance_id)
        if future is None:
            future = self._validated[instance.instance_id] = asyncio.ensure_future(
                grading.validate(instance, self.backend, env_options=self.env_options)
            )
        result = await future
        if not result.valid:
            raise ValueError(f"instance {instance.instance_id} is invalid: {result.reason}")

    async def start(
        self, task: SweInstance, limits: Limits, log: EpisodeLog, mounts: tuple[Mount, ...] = ()
    ) -> TaskSandbox:
        """Validates `task` (once), builds its environment (`RepoEnvError` if it cannot) and starts
        its sandbox with `mounts` and the environment's; enter the result to unpack the repository."""
        await self.check(task)
        base = await asyncio.to_thread(task.base)  # git archive: off the event loop
        venv = await instance_env(task, base, self.env_options)  # built by the validation above
        async with log.timed("sandbox"):
            box = await self.backend.create(
                "python", limits, mounts=(*mounts, venv_mount(venv)) if venv else mounts
            )
        return TaskSandbox(task, base, box, venv is not None, log)

    async def grade(
        self, task: SweInstance, base: Snapshot, agent_tree: Snapshot, log: EpisodeLog, **metrics: float
    ) -> Reward:
        """The episode's reward: the agent's diff graded on a fresh copy; `metrics` are added to
        the episode's."""
        model_patch = diff_snapshots(base, agent_tree)
        try:
            async with log.timed("grade"):
                result = await grading.grade(
                    task, model_patch, self.backend, base, env_options=self.env_options
                )
        except SandboxError as exc:  # the grading sandbox died: not the agent's 0
            raise sandbox_failed(exc) from exc
        except RuntimeError:
            log.fail("grader_error")
            return Reward(0.0, log.metrics(resolved=0.0, **metrics))
        if result.reason.startswith("tests_did_not_finish"):
            log.fail("sandbox_timeout")
        elif result.reason.startswith("test_command_failed"):  # the tests could not start: not the agent's
            log.fail("grader_error")
        return Reward(
            result.reward,
            log.metrics(
                resolved=result.reward,
                f2p_passed=result.f2p_passed / max(len(result.fail_to_pass), 1),
                p2p_passed=result.p2p_passed / max(len(result.pass_to_pass), 1),
                patch_applies=float(not result.reason.startswith("patch_does_not_apply")),
                patch_lines=float(model_patch.count("\n")),
                **metrics,
            ),
        )
