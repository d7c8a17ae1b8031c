"""The sandbox interface: what every backend (local bubblewrap, docker, remote HTTP) implements.

    backend = LocalBackend()                      # or DockerBackend(), RemoteBackend(url, api_key)
    box = await backend.create("python", Limits(memory_mb=256))
    await box.upload("solution.py", b"print(1)")
    result = await box.exec(["python3", "solution.py"], timeout=5)
    result.status, result.exit_code, result.stdout   # "ok", 0, "1\\n"
    await box.close()

A sandbox owns one work directory (``/work`` inside it); every ``exec`` runs there, with the same
limits, and sees the files earlier execs and uploads left. ``exec`` never raises for anything the
command does: a timeout, a memory bomb or a flood of output comes back as a status. It raises
``SandboxError`` only when the sandbox itself is broken (closed, dead, backend unreachable).
"""

from __future__ import annotations

import abc
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "WORKDIR",
    "Backend",
    "ExecResult",
    "Limits",
    "Mount",
    "Sandbox",
    "SandboxError",
    "Status",
    "to_argv",
    "work_path",
]

WORKDIR = "/work"
"""The work directory inside every sandbox."""

MAX_INLINE_SCRIPT = 100_000
"""Longest ``script`` passed as one ``sh -c`` argument (Linux caps one argument at 128 KiB)."""

Status = Literal["ok", "timeout", "memory", "output_limit", "error"]
"""ok: the command ran to its end (any exit code); timeout: killed at the wall-clock or CPU limit;
memory: killed for exceeding the memory limit; output_limit: killed after stdout or stderr passed
``Limits.output_bytes``; error: the command could not be started (e.g. not found)."""


class SandboxError(RuntimeError):
    """The sandbox or its backend failed (not the command run in it)."""


@dataclass(frozen=True)
class Limits:
    """Per-sandbox limits; every exec in the sandbox runs under them. Defaults are safe for
    grading small programs; raise them per profile for heavier work."""

    timeout_s: float = 10.0
    """Wall-clock limit of one exec, seconds (``exec(timeout=)`` overrides it per call)."""
    cpu_s: int = 10
    """CPU-time limit of one exec (RLIMIT_CPU), seconds."""
    memory_mb: int = 512
    """Memory limit (cgroup memory.max where available, and RLIMIT_AS unless `address_space_mb`), MiB."""
    address_space_mb: int | None = None
    """Address-space limit of one exec (RLIMIT_AS; the local backend's), MiB; None: `memory_mb`. For a
    runtime that reserves far more address space than it uses: OpenCode's (bun's JavaScriptCore)
    crashes at a 4,096 MiB RLIMIT_AS while its memory stays near 600 MiB (the harness environment);
    what it uses is then bounded by `memory_mb`'s cgroup only, where the host has one."""
    pids: int = 64
    """Most processes/threads alive at once (cgroup pids.max, RLIMIT_NPROC)."""
    file_size_mb: int = 64
    """Largest file a command may write (RLIMIT_FSIZE), MiB."""
    open_files: int = 256
    """RLIMIT_NOFILE."""
    workdir_mb: int = 256
    """Size of the work directory's tmpfs, MiB."""
    output_bytes: int = 1 << 20
    """Bytes kept per stream (stdout, stderr); output past it is dropped while it streams and the
    command is killed with status output_limit once it passes ``output_kill_factor`` times this."""
    output_kill_factor: int = 8

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "address_space_mb" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number; got {value!r}")
            if name != "timeout_s" and not isinstance(value, int):
                raise ValueError(f"Limits.{name} must be an integer; got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Limits:
        """Limits from a JSON object; unknown keys are an error naming them."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown limits {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


RESERVED_MOUNT_ROOTS = (
    *("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/tmp"),
    *(WORKDIR, "/.palaestra"),
)
"""Where a `Mount` may not go: the sandbox's own system files, work directory and agent."""


@dataclass(frozen=True)
class Mount:
    """A host file or directory shown inside one sandbox (``Backend.create(mounts=...)``): a harness
    binary read-only, or the directory of a unix socket that is the sandbox's one way out."""

    source: str
    """Absolute host path (this process opens it, so it may lie where the sandbox's user cannot go)."""
    target: str
    """Absolute path inside the sandbox, outside its system directories and work directory."""
    writable: bool = False
    """Read-only unless set (a unix socket's directory needs it for ``connect``)."""
    live: bool = False
    """The host changes what is there while the sandbox runs (a socket, a stop file): always a bind
    mount, never a copy (the docker backend's ``mounts="layer"`` copies the others). Writable implies it."""

    def __post_init__(self) -> None:
        if not posixpath.isabs(self.source):
            raise ValueError(f"Mount.source must be an absolute path; got {self.source!r}")
        target = posixpath.normpath(self.target)
        if not posixpath.isabs(self.target) or target != self.target or target == "/":
            raise ValueError(f"Mount.target must be a normalised absolute path below /; got {self.target!r}")
        for root in RESERVED_MOUNT_ROOTS:
            if target == root or target.startswith(root + "/"):
                raise ValueError(
                    f"Mount.target {self.target!r} is inside {root}, which the sandbox owns; "
                    "mount under /opt or /run instead"
                )


@dataclass
class ExecResult:
    status: Status
    exit_code: int | None
    """The exit status; negative for a signal (as in ``subprocess``); None if it never started."""
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    detail: str = ""
    """Why, for statuses other than ok (e.g. "killed after 10.0 s wall clock")."""
    enforced: str = ""
    """How the backend enforced the limits for this exec (e.g. "cgroup v2 (memory, pids) + rlimits",
    or "rlimits only (...why...)"), so a result says what it can be trusted for."""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.exit_code == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Sandbox(abc.ABC):
    """One isolated work directory and the commands run in it."""

    id: str
    limits: Limits

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | list[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (an argv list, or a string for ``sh -c``) or ``script`` (a shell script's
        text) in the work directory. ``timeout`` defaults to ``limits.timeout_s``."""

    @abc.abstractmethod
    async def upload(self, path: str, data: bytes | str) -> None:
        """Write a file, relative to the work directory (parents are created)."""

    @abc.abstractmethod
    async def download(self, path: str) -> bytes:
        """Read a file, relative to the work directory. Raises FileNotFoundError."""

    @abc.abstractmethod
    async def alive(self) -> bool:
        """Cheap check that the sandbox can still run commands."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill everything still running in it and remove it. Idempotent."""

    async def reset(self) -> None:
        """Empty the work directory and /tmp so that the next user starts clean (the pool calls it
        between users). Backends with a faster way override it; raises SandboxError on failure."""
        result = await self.exec(
            [
                "/bin/sh",
                "-c",
                f"chmod -R u+rwx {WORKDIR} /tmp 2>/dev/null; find {WORKDIR} /tmp -mindepth 1 -delete",
            ],
            timeout=30,
        )
        if not result.ok:
            raise SandboxError(f"reset of sandbox {self.id} failed: {result.status} {result.stderr[-500:]}")

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass
class Backend(abc.ABC):
    """Creates sandboxes. ``label`` marks everything a backend starts, so that a later start can
    find and remove what a crashed process leaked."""

    label: str = field(default="palaestra-sandbox", kw_only=True)
    """Marks what this backend starts (keyword-only, so subclasses' own fields come first)."""

    name = "abstract"

    @abc.abstractmethod
    async def create(
        self, profile: str = "python", limits: Limits | None = None, mounts: tuple[Mount, ...] = ()
    ) -> Sandbox:
        """A fresh sandbox. ``profile`` names what is installed in it ("python": python3 and a
        POSIX shell); ``mounts`` host paths shown in it (a backend that cannot raises SandboxError)."""

    @abc.abstractmethod
    async def cleanup_leaked(self) -> int:
        """Remove sandboxes with this backend's label that no live owner holds; returns how many."""

    async def close(self) -> None:
        """Release the backend's own resources (clients, connections). Not abstract: a backend
        without any (local) has nothing to do."""
        return None


def to_argv(cmd: str | list[str] | None, script: str | None) -> list[str]:
    """The argv for ``Sandbox.exec``'s ``cmd`` or ``script`` (exactly one of them)."""
    if (cmd is None) == (script is None):
        raise ValueError("exec needs exactly one of 'cmd' and 'script'")
    if script is not None:
        if len(script.encode()) > MAX_INLINE_SCRIPT:
            raise ValueError(
                f"'script' must be at most {MAX_INLINE_SCRIPT} bytes; got {len(script.encode())} "
                "(upload it as a file and run that instead)"
            )
        return ["/bin/sh", "-c", script]
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"'cmd' must be a non-empty list of strings or a string; got {cmd!r}")
    return list(cmd)


def work_path(path: str) -> str:
    """``path`` (relative to the work directory) as a normalised relative path; raises ValueError
    naming the field for absolute paths and paths that climb out with ``..``."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"'path' must be a non-empty string; got {path!r}")
    if path.startswith("/"):
        raise ValueError(f"'path' must be relative to the work directory; got {path!r}")
    norm = posixpath.normpath(path)
    if norm == "." or norm == ".." or norm.startswith("../"):
        raise ValueError(f"'path' must name a file inside the work directory; got {path!r}")
    return norm
