"""The docker backend: one long-lived, locked-down container per sandbox, warm between execs.

    backend = DockerBackend()                     # DockerBackend(runtime="runsc") for gVisor
    async with await backend.create("python", Limits(memory_mb=256)) as box:
        result = await box.exec("python3 -c 'print(6 * 7)'")

Every container gets: no network at all (``network_mode=none``: only its own loopback), a
read-only root with ``/work``, ``/tmp`` and ``/dev/shm`` as size-capped tmpfs, every capability
dropped, ``no-new-privileges``, pids/memory/CPU limits, and the unprivileged user 10001. Its PID 1
is the image's runner (images/runner.py): per request it starts the command with rlimits and a
seccomp filter, enforces the wall-clock and output limits, tells an OOM kill from a timeout, and
kills everything the command left behind. The host reaches it over a unix socket bind-mounted into
the container, or by ``docker exec`` (docker_channel.py says which and why).

The images are built offline on first use (images/build.py; ``palaestra sandbox build-images``).
Every container carries ``label`` and its owner (host, pid, process start) so that
``cleanup_leaked`` can remove what a crashed owner left. ``runtime`` passes through to docker
(``runsc`` where gVisor is installed). The docker SDK is synchronous; its calls run in threads.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from palaestra.sandbox.base import (
    WORKDIR,
    Backend,
    ExecResult,
    Limits,
    Mount,
    Sandbox,
    SandboxError,
    to_argv,
    work_path,
)
from palaestra.sandbox.bwrap import SHM_MB, TMP_MB
from palaestra.sandbox.docker_channel import RUNNER_SOCKET, ExecChannel, HostSocket, SocketChannel
from palaestra.sandbox.images.rootfs import SANDBOX_UID
from palaestra.sandbox.output import CappedOutput, build_result

__all__ = ["DockerBackend", "DockerSandbox"]

COMMAND_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUTF8": "1",
}
"""The whole environment a command sees (nothing of the host's or the runner's leaks in)."""
ANSWER_GRACE_S = 15.0
"""How long past an exec's own timeout the host waits for the runner before giving up on it."""


def _owner_id() -> str:
    """host:pid:start-ticks of this process; the start time tells a reused pid from ours."""
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    return f"{socket.gethostname()}:{os.getpid()}:{start}"


def _owner_alive(owner: str) -> bool:
    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname():
        return True  # another machine's process: we cannot tell, so we leave it alone
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19] == start
    except (OSError, ValueError, IndexError):
        return False


@dataclass
class DockerBackend(Backend):
    """Sandboxes as docker containers (see the module docstring for what each one is)."""

    runtime: str | None = None
    """OCI runtime, passed through to docker (e.g. ``runsc`` for gVisor); None: the daemon's default."""
    cpus: float = 1.0
    """CPU share of each container (docker ``nano_cpus``)."""
    images: dict[str, str] = field(default_factory=dict)
    """Image per profile, overriding the locally built ``palaestra/sandbox-<profile>`` image."""
    base_url: str | None = None
    """Docker daemon address; None: the environment's (``DOCKER_HOST``, else the local socket)."""
    build: bool = True
    """Build a profile's image on first use if it is missing (takes a few seconds, offline)."""
    channel: str = "auto"
    """How the host reaches the runner in a container (docker_channel.py): "socket" (a unix socket
    bind-mounted in, ~1 ms a request), "exec" (``docker exec`` per request, ~100 ms), or "auto":
    socket with a local engine and the default runtime, else exec."""

    mounts: str = "layer"
    """How a sandbox's mounts (host directories it sees read-only) get in: "layer" (copied into an
    image layer built once per content: works with an engine on another host) or "bind" (read-only
    bind mounts: the engine must see this host's paths). A live or writable mount is always bound."""

    name = "docker"

    def __post_init__(self) -> None:
        if self.channel not in ("auto", "socket", "exec"):
            raise ValueError(f"'channel' must be auto, socket or exec; got {self.channel!r}")
        if self.mounts not in ("layer", "bind"):
            raise ValueError(f"'mounts' must be layer or bind; got {self.mounts!r}")
        self._client: Any = None
        self._owner = _owner_id()
        self._image_tags: dict[str, str] = {}
        self._layers: dict[tuple[str, tuple[Mount, ...]], str] = {}

    def _layered(self, image: str, mounts: tuple[Mount, ...]) -> str:
        """``image`` with the mounts' directories in a layer of their own (built on first use)."""
        if (image, mounts) not in self._layers:
            from palaestra.sandbox.images import build

            self._layers[image, mounts] = build.ensure_layer(
                self.client(), image, [(m.source, m.target) for m in mounts]
            )
        return self._layers[image, mounts]

    @property
    def enforced(self) -> str:
        """How limits hold (every result's ``enforced``)."""
        runtime = self.runtime or "the daemon's default runtime"
        return (
            f"docker ({runtime}): container cgroup (memory, pids, cpu), no network, read-only root, "
            "no capabilities; rlimits (cpu, fsize, nofile) and a seccomp deny-list per exec"
        )

    def client(self) -> Any:
        if self._client is None:
            import docker

            try:
                self._client = (
                    docker.DockerClient(base_url=self.base_url) if self.base_url else docker.from_env()
                )
                self._client.ping()
            except docker.errors.DockerException as exc:
                self._client = None
                raise SandboxError(f"cannot reach the docker engine: {exc}") from exc
        return self._client

    def _image(self, profile: str) -> str:
        if profile in self.images:
            return self.images[profile]
        if profile not in self._image_tags:
            from palaestra.sandbox.images import build

            if profile not in build.IMAGES or profile == "server":
                raise ValueError(f"'profile' must be one of: python; got {profile!r}")
            if self.build:
                self._image_tags[profile] = build.ensure_image(self.client(), profile)
            else:
                self._image_tags[profile] = f"{build.REPOSITORY}-{profile}:latest"
        return self._image_tags[profile]

    def run_options(self, limits: Limits) -> dict[str, Any]:
        """The container's confinement, as docker SDK ``containers.run`` keywords."""
        # Files in the tmpfs mounts are charged to the container's memory cgroup, so the cgroup
        # gets room for them (full) on top of what commands may allocate, as the local backend's.
        memory = f"{limits.memory_mb + limits.workdir_mb + TMP_MB + SHM_MB}m"
        owner = f"uid={SANDBOX_UID},gid={SANDBOX_UID}"
        return {
            "network_mode": "none",
            "read_only": True,
            # The only writable places, all size-capped: /work, /tmp and /dev/shm (as in the
            # local backend). ipc none leaves no docker /dev/shm of its own, and the read-only
            # tmpfs covers docker's writable /dev/mqueue.
            "tmpfs": {
                WORKDIR: f"size={limits.workdir_mb}m,{owner},mode=0700,exec",
                "/tmp": f"size={TMP_MB}m,{owner},mode=1777,exec",
                "/dev/shm": f"size={SHM_MB}m,{owner},mode=1777,noexec",
                "/dev/mqueue": "ro,size=4k",
            },
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": limits.pids + 2,  # + the idle PID 1 and the runner of the current exec
            "mem_limit": memory,
            "memswap_limit": memory,
            "nano_cpus": int(self.cpus * 1e9),
            "user": f"{SANDBOX_UID}:{SANDBOX_UID}",
            "working_dir": WORKDIR,
            "ipc_mode": "none",
            "hostname": "sandbox",
            "log_config": {"type": "none", "config": {}},
            "runtime": self.runtime,
            "labels": {self.label: "1", f"{self.label}.owner": self._owner},
        }

    def uses_socket(self) -> bool:
        if self.channel != "auto":
            return self.channel == "socket"
        local = self.client().api.base_url.startswith("http+docker://localhost")  # a unix socket
        return local and self.runtime in (None, "runc")

    async def create(
        self, profile: str = "python", limits: Limits | None = None, mounts: tuple[Mount, ...] = ()
    ) -> DockerSandbox:
        limits = limits or Limits()
        image = await asyncio.to_thread(self._image, profile)
        copied = tuple(m for m in mounts if not (m.live or m.writable)) if self.mounts == "layer" else ()
        if copied:
            image = await asyncio.to_thread(self._layered, image, copied)
            mounts = tuple(m for m in mounts if m not in copied)
        name = f"{self.label}-{uuid.uuid4().hex[:12]}"
        container, conn = await asyncio.to_thread(self._start, image, name, limits, tuple(mounts))
        if conn is not None:
            channel = await SocketChannel.open(name, conn)
        else:
            channel = ExecChannel(name, self.client(), container.id, 16 * limits.output_bytes + (1 << 16))
        return DockerSandbox(self, container, limits, channel)

    def _start(
        self, image: str, name: str, limits: Limits, mounts: tuple[Mount, ...] = ()
    ) -> tuple[Any, socket.socket | None]:
        """Run the container; with the socket channel, also wait for its runner to connect."""
        options = self.run_options(limits)
        # The docker engine (root) mounts them: a source in a closed home is no obstacle.
        options["volumes"] = {
            m.source: {"bind": m.target, "mode": "rw" if m.writable else "ro"} for m in mounts
        }
        host = HostSocket() if self.uses_socket() else None
        try:
            if host is not None:
                options["volumes"][host.path] = {"bind": RUNNER_SOCKET, "mode": "ro"}
                options["environment"] = {"PALAESTRA_RUNNER_SOCKET": RUNNER_SOCKET}  # PID 1's only
            container = self._run(image, name, options)
            if host is None:
                return container, None
            try:
                container.reload()
                return container, host.accept_init(container.attrs["State"]["Pid"], wait_s=60)
            except BaseException:
                self._remove_quietly(name)
                raise
        finally:
            if host is not None:
                host.close()

    def _run(self, image: str, name: str, options: dict[str, Any]) -> Any:
        import docker

        try:
            return self.client().containers.run(
                image, name=name, detach=True, stop_signal="SIGKILL", **options
            )
        except docker.errors.ImageNotFound as exc:
            raise SandboxError(
                f"image {image} is missing; build it with `palaestra sandbox build-images`"
            ) from exc
        except docker.errors.APIError as exc:
            # e.g. "unknown or invalid runtime name: runsc" when gVisor is not installed
            self._remove_quietly(name)
            raise SandboxError(
                f"docker could not start a sandbox (runtime={self.runtime!r}): {exc.explanation}"
            ) from exc

    def _remove_quietly(self, name: str) -> None:
        import docker

        try:
            self.client().containers.get(name).remove(force=True)
        except docker.errors.DockerException:
            pass

    async def cleanup_leaked(self) -> int:
        def sweep() -> int:
            removed = 0
            for c in self.client().containers.list(all=True, filters={"label": self.label}):
                owner = c.labels.get(f"{self.label}.owner", "")
                if owner != self._owner and not _owner_alive(owner):
                    self._remove_quietly(c.id)
                    removed += 1
            return removed

        return await asyncio.to_thread(sweep)

    async def close(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None


class DockerSandbox(Sandbox):
    """One warm container; execs, uploads and downloads in it run one at a time (each exec ends by
    killing every process in the container but PID 1)."""

    def __init__(self, backend: DockerBackend, container: Any, limits: Limits, channel: Any) -> None:
        self.backend = backend
        self.container = container
        self._channel = channel
        self.id = container.name
        self.limits = limits
        self._lock = asyncio.Lock()
        self._closed = False

    async def exec(
        self,
        cmd: str | list[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        argv = to_argv(cmd, script)
        timeout = self.limits.timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"'timeout' must be > 0 seconds; got {timeout}")
        lim = self.limits
        spec = {
            "argv": argv,
            "timeout": timeout,
            "cpu_s": lim.cpu_s,
            "file_size_mb": lim.file_size_mb,
            "open_files": lim.open_files,
            "output_bytes": lim.output_bytes,
            "output_kill_factor": lim.output_kill_factor,
            "env": COMMAND_ENV,
        }
        data = stdin.encode() if isinstance(stdin, str) else stdin or b""
        async with self._lock:
            self._check_open()
            code, out, err = await self._channel.call("exec", spec, data, timeout + ANSWER_GRACE_S)
            if code == 0:
                return self._result(json.loads(out), timeout)
            return await self._runner_failed(code, err, timeout)

    def _result(self, seen: dict[str, Any], timeout: float) -> ExecResult:
        """The runner's observations -> one status, by the rules every backend shares."""
        streams = []
        for name in ("stdout", "stderr"):
            capped = CappedOutput.for_limits(self.limits)
            capped.feed(seen.get(name, "").encode("latin-1"))  # latin-1 carried the raw bytes
            capped.total = int(seen.get(f"{name}_total", 0))
            streams.append(capped)
        result = build_result(
            exit_code=seen.get("exit_code"),
            stdout=streams[0],
            stderr=streams[1],
            duration_s=float(seen.get("duration_s", 0.0)),
            killed=seen.get("killed"),
            oom_killed=bool(seen.get("oom_killed")),
            start_error=seen.get("start_error"),
            timeout_s=timeout,
            memory_mb=self.limits.memory_mb,
        )
        result.enforced = self.backend.enforced
        return result

    async def _runner_failed(self, code: int | None, err: bytes, timeout: float) -> ExecResult:
        """The runner itself did not answer: killed by the OOM killer along with the command, or
        stuck past its deadline. Clean up, then say which."""
        enforced = self.backend.enforced
        if code is None:
            if isinstance(self._channel, SocketChannel):
                # PID 1 itself is stuck: this sandbox cannot be trusted to clean up; end it.
                await self.close()
                return ExecResult(
                    "timeout", None, "", "", detail="runner did not answer; sandbox closed", enforced=enforced
                )
            await self._channel.call("reap", None, b"", ANSWER_GRACE_S)
            return ExecResult(
                "timeout", None, "", "", detail=f"no answer within {timeout:g} s (+ grace)", enforced=enforced
            )
        await self._channel.call("reap", None, b"", ANSWER_GRACE_S)
        if code == 137:
            return ExecResult(
                "memory",
                -9,
                "",
                "",
                detail="the memory cgroup's OOM killer ended the exec",
                enforced=enforced,
            )
        raise SandboxError(
            f"sandbox {self.id}: runner failed (exit {code}): {err[-2000:].decode(errors='replace')}"
        )

    async def upload(self, path: str, data: bytes | str) -> None:
        path = work_path(path)
        payload = data.encode() if isinstance(data, str) else data
        async with self._lock:
            self._check_open()
            code, _, err = await self._channel.call("put", {"path": path}, payload, 60.0)
        _raise_file_error(code, err, path)

    async def download(self, path: str) -> bytes:
        path = work_path(path)
        async with self._lock:
            self._check_open()
            code, out, err = await self._channel.call("get", {"path": path}, b"", 60.0)
        _raise_file_error(code, err, path)
        return out

    async def alive(self) -> bool:
        if self._closed:
            return False
        if isinstance(self._channel, SocketChannel):  # the runner answers: the container is fine
            async with self._lock:
                try:
                    code, _, _ = await self._channel.call("ping", None, b"", 10.0)
                except SandboxError:
                    return False
            return code == 0

        def state() -> bool:
            try:
                self.container.reload()
                return self.container.status == "running"
            except Exception:
                return False

        return await asyncio.to_thread(state)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._channel.close()
        await asyncio.to_thread(self.backend._remove_quietly, self.container.id)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")


def _raise_file_error(code: int | None, err: bytes, path: str) -> None:
    if code == 0:
        return
    try:
        info = json.loads(err)
    except ValueError:
        info = {"error": "", "detail": err.decode(errors="replace")}
    if info.get("error") == "not_found":
        raise FileNotFoundError(f"{path}: not in the sandbox's work directory")
    if info.get("error") == "PermissionError":
        raise PermissionError(info.get("detail", path))
    if info.get("error") in ("OSError", "IsADirectoryError", "NotADirectoryError", "FileExistsError"):
        raise OSError(f"{path}: {info.get('detail')}")
    raise SandboxError(f"{path}: {info.get('detail') or f'runner exit {code}'}")
