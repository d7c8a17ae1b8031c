"""One episode of a Harbor task: its sandbox, the agent's phase, then the verifier per Harbor's contract.

    async with Trial.open(task, built, backend, extra_mounts) as trial:   # a fresh copy of the layers
        await agent_run(trial)                     # trial.exec(...) runs in the task's WORKDIR
        rewards = await trial.verify()             # Rewards: primary value + every named reward

The sandbox mounts a per-episode copy of each layer root (writable, at its place: ``/app``...),
``/logs`` (``/logs/agent``, ``/logs/verifier``), an empty ``/tests`` and ``/solution`` (host
directories: filled only when their phase comes). Limits: ``[agent].timeout_sec`` for each agent
command (``[verifier].timeout_sec`` for test.sh), ``[environment].memory_mb``, CPU time
``cpus`` x the phase's wall clock, ``storage_mb`` as the largest file a command may write.

The verifier (Harbor's shared mode: the agent's sandbox, after the agent's processes are gone):
``/tests`` is emptied (nothing the agent put there survives) and filled with the task's tests/,
the reward files are removed, ``bash /tests/test.sh`` runs in the WORKDIR with the Dockerfile's ENV
and ``[verifier].env``, its output in ``/logs/verifier/test-stdout.txt``. Then ``reward.json``
(first, as Harbor reads it: an object of named numbers, or one number) or ``reward.txt`` (one
float). The primary reward is the ``reward`` key (Harbor's one-dimensional convention), else the
only key, else `reward_key`. A test.sh that times out, cannot start, or leaves no readable reward
raises `GraderFailure`: the episode is not the agent's zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from palaestra.environments.harbor.build import BuiltEnv, open_to_all, sandbox_owner
from palaestra.environments.harbor.task import HarborTask
from palaestra.sandbox.base import Backend, ExecResult, Limits, Mount, Sandbox

__all__ = ["GraderFailure", "Rewards", "Trial", "read_rewards"]

OUTPUT_TAIL = 400


class GraderFailure(RuntimeError):
    """The verifier could not grade the episode (timed out, did not run, no readable reward)."""


@dataclass(frozen=True)
class Rewards:
    value: float
    """The primary reward."""
    named: dict[str, float]
    """Every reward the verifier wrote (``{"reward": x}`` for reward.txt)."""


def read_rewards(verifier_dir: Path, reward_key: str | None = None) -> Rewards:
    """The rewards test.sh left in `verifier_dir` (Harbor's contract; module docstring)."""
    json_path, text_path = verifier_dir / "reward.json", verifier_dir / "reward.txt"
    if json_path.is_file():
        try:
            raw = json.loads(json_path.read_text())
        except ValueError as exc:
            raise GraderFailure(f"reward.json is not JSON: {exc}") from None
        named = raw if isinstance(raw, dict) else {"reward": raw}
    elif text_path.is_file():
        text = text_path.read_text().strip()
        try:
            named = {"reward": float(text)}
        except ValueError:
            raise GraderFailure(f"reward.txt holds {text[:60]!r}, not a number") from None
    else:
        raise GraderFailure("test.sh wrote neither /logs/verifier/reward.txt nor reward.json")
    for key, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise GraderFailure(f"reward {key!r} is {value!r}, not a finite number")
    if not named:
        raise GraderFailure("reward.json is an empty object")
    key = reward_key or ("reward" if "reward" in named else next(iter(named)) if len(named) == 1 else None)
    if key not in named:
        raise GraderFailure(
            f"reward.json has {sorted(named)} and no {key or 'reward'!r}: name the primary one with reward_key"
        )
    return Rewards(float(named[key]), {k: float(v) for k, v in named.items()})


@dataclass
class Trial:
    task: HarborTask
    built: BuiltEnv
    sandbox: Sandbox
    host: Path
    """The episode's host directory: layers/, logs/, tests/, solution/."""
    owner: int | None = None
    """The host uid the sandbox's files are handed to (`build.sandbox_owner`)."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        task: HarborTask,
        built: BuiltEnv,
        backend: Backend,
        mounts: tuple[Mount, ...] = (),
        address_space_mb: int | None = None,
    ) -> AsyncIterator[Trial]:
        """A fresh sandbox of `task` with a copy of `built`'s layers and `mounts` (the agent's),
        allowing `address_space_mb` (the agent runtime's, when it reserves more than the task's memory)."""
        host = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=f"palaestra-harbor-{task.task_id}-"))
        try:
            owner = sandbox_owner(backend)
            await asyncio.to_thread(_prepare, host, built, owner)
            own = [Mount(str(host / "layers" / str(i)), r, writable=True) for i, r in enumerate(built.roots)]
            own += [
                Mount(str(host / name), f"/{name}", writable=True) for name in ("logs", "tests", "solution")
            ]
            phase = max(task.agent_timeout_s, task.verifier_timeout_s)
            limits = Limits(
                timeout_s=task.agent_timeout_s,
                cpu_s=max(1, math.ceil(phase * task.cpus)),
                memory_mb=task.memory_mb,
                address_space_mb=None if address_space_mb is None else max(address_space_mb, task.memory_mb),
                pids=512,
                file_size_mb=task.storage_mb or 1024,
                workdir_mb=512,
                output_bytes=4 << 20,
            )
            sandbox = await backend.create(built.profile, limits, mounts=(*own, *mounts))
            try:
                yield cls(task, built, sandbox, host, owner)
            finally:
                await sandbox.close()
        finally:
            await asyncio.to_thread(shutil.rmtree, host, True)

    def script(self, command: str, env: dict[str, str] | None = None) -> str:
        """`command` as a script run in the task's WORKDIR with its Dockerfile ENV, its
        ``[environment].env`` and `env`."""
        values = {**self.built.env, **self.task.env, **(env or {})}
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items())
        return f"{exports}cd {shlex.quote(self.built.workdir)} && {command}\n"

    async def exec(
        self, command: str, *, timeout: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        return await self.sandbox.exec(script=self.script(command, env), timeout=timeout)

    async def put_solution(self) -> None:
        """The oracle's files at /solution (only the oracle agent asks)."""
        await asyncio.to_thread(_fill, self.host / "solution", self.task.solution_dir)

    async def verify(self, reward_key: str | None = None) -> Rewards:
        """Runs tests/test.sh as the verifier; GraderFailure if it cannot grade."""
        verifier = self.host / "logs" / "verifier"
        await asyncio.to_thread(_fill, self.host / "tests", self.task.tests_dir)
        for name in ("reward.txt", "reward.json"):
            (verifier / name).unlink(missing_ok=True)
        result = await self.exec(
            "bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
            timeout=self.task.verifier_timeout_s,
            env=self.task.verifier_env,
        )
        if result.status != "ok":
            raise GraderFailure(
                f"harbor task {self.task.task_id}: test.sh {result.status} ({result.detail or 'did not run'}; "
                f"[verifier].timeout_sec = {self.task.verifier_timeout_s:g})"
            )
        try:
            return read_rewards(verifier, reward_key)
        except GraderFailure as exc:
            stdout = verifier / "test-stdout.txt"
            tail = stdout.read_text(errors="replace")[-OUTPUT_TAIL:] if stdout.is_file() else ""
            raise GraderFailure(
                f"harbor task {self.task.task_id}: {exc} (test.sh exit {result.exit_code}; output: {tail!r})"
            ) from None


def _prepare(host: Path, built: BuiltEnv, owner: int | None) -> None:
    os.chmod(host, 0o755)
    for i in range(len(built.roots)):
        shutil.copytree(built.layer(i), host / "layers" / str(i), symlinks=True)
    for name in ("logs/agent", "logs/verifier", "tests", "solution"):
        (host / name).mkdir(parents=True, exist_ok=True)
    open_to_all(host / "layers", owner)
    open_to_all(host / "logs", owner)
    for name in ("tests", "solution"):
        open_to_all(host / name)


def _fill(target: Path, source: Path) -> None:
    """Empties `target` (whatever the agent left there) and copies `source` into it."""
    for child in list(target.iterdir()):  # the directory itself stays: it is what the sandbox mounts
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    open_to_all(target)
