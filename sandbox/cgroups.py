"""Memory and process-count limits for local sandboxes through cgroups, where the host allows.

``CgroupHost.detect()`` finds a place to make one cgroup per sandbox:

* cgroup v2: a ``palaestra-sandbox`` cgroup at the root of the mounted unified hierarchy with the
  ``memory`` and ``pids`` controllers enabled for its children. Needs root, and a hierarchy root
  without processes of its own (true on a systemd host; false inside most containers, whose
  cgroup namespace root holds the container's processes).
* cgroup v1: ``palaestra-sandbox`` below this process's own cgroup in the ``memory`` and ``pids``
  hierarchies (so the sandboxes stay inside whatever limit this process already has).

When neither works it returns None and a reason; the local backend then relies on rlimits alone
and says so in every result's ``enforced`` field. The sandbox's whole process tree (bubblewrap,
the agent, every exec) lives in its cgroup, so ``memory.max`` bounds the tree and its tmpfs files,
``pids.max`` bounds a fork bomb, and the cgroup's ``oom_kill`` counter tells a memory kill apart
from any other SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupHost", "SandboxCgroup"]

BASE = "palaestra-sandbox"


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup (v2: one directory; v1: one per hierarchy)."""

    memory: Path | None
    pids: Path | None
    version: int

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys(d for d in (self.memory, self.pids) if d is not None))

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (before it execs bubblewrap)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def set_limits(self, memory_bytes: int, pids: int) -> None:
        if self.version == 2:
            _write(self.memory / "memory.max", memory_bytes)
            _write_if_exists(self.memory / "memory.swap.max", 0)
            _write(self.pids / "pids.max", pids)
            return
        if self.memory is not None:
            _write(self.memory / "memory.limit_in_bytes", memory_bytes)
            # memsw (memory + swap) must not be below the memory limit; equal means no swap.
            _write_if_exists(self.memory / "memory.memsw.limit_in_bytes", memory_bytes)
        if self.pids is not None:
            _write(self.pids / "pids.max", pids)

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this cgroup so far."""
        if self.memory is None:
            return 0
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.memory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox now (its processes and its tmpfs files)."""
        if self.memory is None:
            return 0
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int((self.memory / name).read_text())
        except OSError:
            return 0

    def pids_in(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup."""
        for d in self.dirs:
            if (d / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(d / "cgroup.kill", 1)
        for _ in range(50):
            pids = self.pids_in()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self, timeout: float = 5.0) -> bool:
        """Remove the cgroup once its processes are gone; False if it was still busy."""
        deadline = time.monotonic() + timeout
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return False
                    self.kill()
                    time.sleep(0.02)
        return True


@dataclass
class CgroupHost:
    """Where this host lets us make sandbox cgroups."""

    version: int
    memory_base: Path | None
    pids_base: Path | None

    def describe(self) -> str:
        controllers = [n for n, d in (("memory", self.memory_base), ("pids", self.pids_base)) if d]
        return f"cgroup v{self.version} ({', '.join(controllers)})"

    def create(self, name: str, memory_bytes: int, pids: int) -> SandboxCgroup:
        cg = self.open(name)
        for d in cg.dirs:
            d.mkdir()
        try:
            cg.set_limits(memory_bytes, pids)
        except OSError:
            cg.remove()
            raise
        return cg

    def open(self, name: str) -> SandboxCgroup:
        memory = self.memory_base / name if self.memory_base else None
        pids = self.pids_base / name if self.pids_base else None
        return SandboxCgroup(memory=memory, pids=pids, version=self.version)

    def names(self) -> set[str]:
        """The sandbox cgroups that exist now (any owner)."""
        found: set[str] = set()
        for base in (self.memory_base, self.pids_base):
            if base is not None and base.is_dir():
                found.update(p.name for p in base.iterdir() if p.is_dir())
        return found

    def remove_stale(self, is_stale: Callable[[str], bool]) -> list[str]:
        """Kill and remove every sandbox cgroup whose name ``is_stale``; returns their names."""
        removed = []
        for name in sorted(self.names()):
            if is_stale(name):
                cg = self.open(name)
                cg.kill()
                if cg.remove():
                    removed.append(name)
        return removed

    @classmethod
    def detect(cls) -> tuple[CgroupHost | None, str]:
        """The usable cgroup setup and a description, or None and why not."""
        if os.geteuid() != 0:
            return None, "not root: cgroups are not writable"
        mounts = _cgroup_mounts()
        own = _own_cgroups()
        reasons = []
        if "cgroup2" in mounts:
            host, why = _detect_v2(Path(mounts["cgroup2"]))
            if host is not None:
                return host, host.describe()
            reasons.append(f"v2: {why}")
        bases: dict[str, Path] = {}
        for controller in ("memory", "pids"):
            if controller not in mounts:
                continue
            base = Path(mounts[controller]) / own.get(controller, "/").lstrip("/") / BASE
            try:
                base.mkdir(exist_ok=True)
                probe = base / f"probe-{os.getpid()}"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
                bases[controller] = base
            except OSError as exc:
                reasons.append(f"v1 {controller}: {exc}")
        if bases:
            host = cls(version=1, memory_base=bases.get("memory"), pids_base=bases.get("pids"))
            return host, host.describe()
        return None, "; ".join(reasons) or "no cgroup hierarchy mounted"


def _detect_v2(mount: Path) -> tuple[CgroupHost | None, str]:
    try:
        available = (mount / "cgroup.controllers").read_text().split()
        missing = {"memory", "pids"} - set(available)
        if missing:
            return None, f"controllers {sorted(missing)} not available at {mount}"
        enabled = (mount / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            _write(mount / "cgroup.subtree_control", "+memory +pids")
        base = mount / BASE
        base.mkdir(exist_ok=True)
        if not {"memory", "pids"} <= set((base / "cgroup.subtree_control").read_text().split()):
            _write(base / "cgroup.subtree_control", "+memory +pids")
    except OSError as exc:
        return None, f"{mount}: {exc.strerror or exc}"
    return CgroupHost(version=2, memory_base=base, pids_base=base), ""


def _cgroup_mounts() -> dict[str, str]:
    """{"cgroup2": mountpoint, "memory": mountpoint, "pids": mountpoint} as far as mounted."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = (right.split() + ["", ""])[:3]
            point = left.split()[4]
            if fstype == "cgroup2":
                found.setdefault("cgroup2", point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in ("memory", "pids"):
                        found.setdefault(opt, point)
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                if c:
                    own[c] = path
    return own


def _write(path: Path, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _write_if_exists(path: Path, value: object) -> None:
    if path.exists():
        _write(path, value)
