"""A Harbor task directory, read into a typed record; what we cannot honour refused at load.

    task = load_task("environments/harbor/examples/fix-greeting")
    tasks = load_tasks("environments/harbor/examples")      # a directory of task dirs, or one task

The format (Harbor 0.25's task model): ``task.toml`` (``[agent]`` / ``[verifier]`` timeouts,
``[environment]`` resources and network, ``[solution].env``, ``[metadata]``), ``instruction.md`` (what
the agent is asked), ``environment/Dockerfile`` (the agent's starting filesystem; `dockerfile.py`),
``tests/test.sh`` (uploaded to ``/tests`` after the agent ends; writes ``/logs/verifier/reward.txt`` or
``reward.json``) and optionally ``solution/solve.sh`` (the oracle).

Refused, each with one line naming the task and the field (docs/environments.md, Harbor: why):
multi-step tasks (``steps``), a separate verifier environment, a compose environment, Windows,
GPUs/TPUs, MCP servers, healthchecks, skills, a prior ``trajectory.json``, artifacts, a prebuilt
``docker_image`` without a Dockerfile (with one, the Dockerfile is built), and (when
``internet="refuse"``) a task that asks for the network. Otherwise a task that asks for the network
runs isolated: our sandboxes have none (the session tunnel is a harness's only way out).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HarborTask", "TaskError", "load_task", "load_tasks"]

DEFAULT_AGENT_TIMEOUT_S = 600.0
"""The agent's wall clock when ``[agent].timeout_sec`` is not set (Harbor leaves it to the run)."""
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's default ``[verifier].timeout_sec``."""
DEFAULT_MEMORY_MB = 2048
"""The sandbox's memory when ``[environment].memory_mb`` is not set."""


class TaskError(ValueError):
    """A task directory we cannot run: the message names the task and what to change."""


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task, as the environment runs it."""

    task_id: str
    """The directory's name."""
    path: Path
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    build_timeout_s: float
    cpus: float
    """CPUs the task asks for: bounds CPU time to ``cpus`` x each phase's wall clock."""
    memory_mb: int
    storage_mb: int | None
    """Largest file a command may write (our sandboxes cap files, not a disk)."""
    wants_internet: bool
    """The task asked for the network (``network_mode`` public/allowlist, ``allow_internet``)."""
    env: dict[str, str] = field(default_factory=dict)
    """``[environment].env``: set for the agent's and the verifier's commands."""
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    """``[environment].workdir``: overrides the Dockerfile's WORKDIR."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def dockerfile(self) -> Path:
        return self.path / "environment" / "Dockerfile"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def has_solution(self) -> bool:
        return (self.solution_dir / "solve.sh").is_file()


def _section(config: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise TaskError(f"{where}: [{name}] must be a table; got {value!r}")
    return value


def _number(table: dict[str, Any], key: str, default: float | None, where: str) -> float | None:
    value = table.get(key, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise TaskError(f"{where}.{key}: must be a positive number; got {value!r}")
    return float(value)


_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}")


def _strings(table: dict[str, Any], key: str, where: str) -> dict[str, str]:
    """An env table: literal values, and ``${VAR:-default}`` templates as their default; a bare
    ``${VAR}`` is refused (the host's environment does not pass into the sandbox)."""
    value = table.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TaskError(f"{where}.{key}: must be a table of strings; got {value!r}")
    out = {}
    for name, text in value.items():
        bare = next((m[1] for m in _TEMPLATE.finditer(text) if m[2] is None), None)
        if bare is not None:
            raise TaskError(
                f"{where}.{key}.{name}: ${{{bare}}} reads the host's environment, which does not pass into "
                "the sandbox: write the value, or ${VAR:-default}"
            )
        out[name] = _TEMPLATE.sub(lambda m: m[3], text)
    return out


def _refuse(where: str, what: str, why: str) -> None:
    raise TaskError(f"{where}: {what} is not supported ({why})")


def load_task(path: str | Path, *, internet: str = "isolate") -> HarborTask:
    """The task in directory `path`; `internet` "isolate" (a task asking for the network runs
    without it) or "refuse" (such a task is a TaskError)."""
    root = Path(path).resolve()
    where = f"harbor task {root.name}"
    config_path = root / "task.toml"
    for required in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh"):
        if not (root / required).is_file():
            if required == "environment/Dockerfile" and (root / "environment").is_dir():
                compose = sorted(p.name for p in (root / "environment").iterdir())
                _refuse(
                    where,
                    f"an environment without a Dockerfile ({', '.join(compose) or 'empty'})",
                    "only environment/Dockerfile builds offline",
                )
            raise TaskError(f"{where}: {required} is missing (a Harbor task needs it)")
    try:
        config = tomllib.loads(config_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{where}: task.toml does not parse: {exc}") from None
    agent = _section(config, "agent", f"{where} [agent]")
    verifier = _section(config, "verifier", f"{where} [verifier]")
    env = _section(config, "environment", f"{where} [environment]")
    solution = _section(config, "solution", f"{where} [solution]")
    if config.get("steps"):
        _refuse(where, "steps (a multi-step task)", "one agent phase and one verifier per episode")
    if verifier.get("environment") or verifier.get("environment_mode") == "separate":
        _refuse(
            where,
            "[verifier] environment_mode = separate",
            "the verifier runs in the agent's sandbox after the agent's processes are gone",
        )
    if str(env.get("os", "linux")).lower() != "linux":
        _refuse(where, f"[environment].os = {env['os']!r}", "our sandboxes are Linux")
    if env.get("gpus") or env.get("tpu") or env.get("gpu_types"):
        _refuse(where, "[environment] gpus/tpu", "the sandboxes have no accelerators")
    if env.get("mcp_servers"):
        _refuse(where, "[environment].mcp_servers", "give MCP servers through the harness environment")
    if env.get("healthcheck"):
        _refuse(where, "[environment].healthcheck", "nothing is started in the sandbox before the agent")
    if env.get("skills_dir"):
        _refuse(where, "[environment].skills_dir", "no harness here reads a skills directory")
    if (root / "trajectory.json").is_file():
        _refuse(
            where, "trajectory.json (prior agent context)", "every episode starts from the instruction alone"
        )
    if config.get("artifacts") or verifier.get("collect"):
        _refuse(where, "artifacts / [[verifier.collect]]", "the verifier's reward file is all that is read")
    for phase, table in (("agent", agent), ("verifier", verifier)):
        if table.get("user") not in (None, "root", 0):
            _refuse(
                where, f"[{phase}].user = {table['user']!r}", "every command runs as the sandbox's one user"
            )
    mode = env.get("network_mode")
    allow = env.get("allow_internet")
    wants_internet = (mode in ("public", "allowlist")) if mode is not None else allow is not False
    for table in (agent, verifier):  # a phase override asking for the network
        wants_internet = wants_internet or table.get("network_mode") in ("public", "allowlist")
    if internet not in ("isolate", "refuse"):
        raise ValueError(f"internet must be 'isolate' or 'refuse'; got {internet!r}")
    explicit = mode is not None or allow is not None
    if internet == "refuse" and wants_internet and explicit:
        raise TaskError(
            f"{where}: asks for the network (network_mode={mode!r}, allow_internet={allow!r}); our sandboxes "
            "have none: set network_mode = \"no-network\" or run with internet='isolate'"
        )
    memory = _number(env, "memory_mb", DEFAULT_MEMORY_MB, f"{where} [environment]")
    storage = _number(env, "storage_mb", None, f"{where} [environment]")
    workdir = env.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise TaskError(f"{where} [environment].workdir: must be an absolute path; got {workdir!r}")
    metadata = config.get("metadata", {})
    return HarborTask(
        task_id=root.name,
        path=root,
        instruction=(root / "instruction.md").read_text(),
        agent_timeout_s=_number(agent, "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, f"{where} [agent]"),
        verifier_timeout_s=_number(
            verifier, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, f"{where} [verifier]"
        ),
        build_timeout_s=_number(env, "build_timeout_sec", 600.0, f"{where} [environment]"),
        cpus=_number(env, "cpus", 1.0, f"{where} [environment]"),
        memory_mb=int(memory),
        storage_mb=int(storage) if storage else None,
        wants_internet=wants_internet and explicit,
        env=_strings(env, "env", f"{where} [environment]"),
        verifier_env=_strings(verifier, "env", f"{where} [verifier]"),
        solution_env=_strings(solution, "env", f"{where} [solution]"),
        workdir=workdir,
        metadata=metadata if isinstance(metadata, dict) else {},
    )


def load_tasks(path: str | Path, *, internet: str = "isolate") -> list[HarborTask]:
    """Every task under `path`: the task itself when it holds a task.toml, else each
    subdirectory that does (sorted by name). A task that cannot run is a TaskError."""
    root = Path(path)
    if not root.is_dir():
        raise TaskError(f"harbor path {str(path)!r} is not a directory (a task, or a directory of tasks)")
    if (root / "task.toml").is_file():
        return [load_task(root, internet=internet)]
    dirs = sorted(p for p in root.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise TaskError(f"harbor path {str(path)!r} holds no task.toml, nor any directory with one")
    return [load_task(d, internet=internet) for d in dirs]
