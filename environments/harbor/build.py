"""A task's environment built offline, once per content, into host directories (its layer roots).

    built = await build_environment(task, backend)      # BuiltEnv: layer dirs, workdir, env, cache_hit
    built.root                                           # ~/.cache/palaestra/harbor/envs/<key>/

The key hashes the Dockerfile, every file of its context, the backend's name and `BUILD_VERSION`;
a build that finished leaves ``build.json`` last, so a build cut short is redone. Steps run in
order (`dockerfile.py`): WORKDIR and COPY on the host, RUN in one build sandbox of the backend
that mounts the layer roots writable (no network: a RUN that downloads fails, naming its line).
The layer files are left writable by every user: the sandboxes' user (nobody under bubblewrap,
uid 10001 in the docker image) edits them in each episode's copy.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from palaestra.environments.harbor.dockerfile import BuildPlan, DockerfileError, read_dockerfile
from palaestra.environments.harbor.task import HarborTask
from palaestra.sandbox.base import Backend, Limits, Mount

__all__ = ["BUILD_VERSION", "BuiltEnv", "build_environment", "cache_root", "open_to_all", "sandbox_owner"]

BUILD_VERSION = "v1"
_locks: dict[str, asyncio.Lock] = {}  # one build per key at a time in this process


@dataclass(frozen=True)
class BuiltEnv:
    root: Path
    """The build's directory: ``layers/<i>`` per layer root, ``build.json``."""
    roots: tuple[str, ...]
    """Where each ``layers/<i>`` is mounted in the sandbox."""
    profile: str
    workdir: str
    env: dict[str, str]
    build_s: float
    """Seconds the build took (when it ran; the recorded time on a cache hit)."""
    cache_hit: bool

    def layer(self, i: int) -> Path:
        return self.root / "layers" / str(i)


def cache_root() -> Path:
    return Path(os.environ.get("PALAESTRA_HARBOR_CACHE") or Path.home() / ".cache/palaestra/harbor")


def sandbox_owner(backend: Backend) -> int | None:
    """The host uid that `backend`'s commands run as, when this process (root) can hand files to
    it: nobody under bubblewrap, the image's user (10001) under docker; None otherwise."""
    if os.geteuid() != 0:
        return None
    if backend.name == "docker":
        from palaestra.sandbox.images.rootfs import SANDBOX_UID

        return SANDBOX_UID
    return getattr(backend, "sandbox_uid", None)


def open_to_all(path: Path, owner: int | None = None) -> None:
    """Every user may read and write under `path` (and enter its directories); owned by `owner`
    when given, so that the sandbox's user may also chmod what the Dockerfile copied."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o777)
        if owner is not None:
            os.chown(dirpath, owner, owner)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o666)
            if owner is not None:
                os.lchown(p, owner, owner)


def _key(task: HarborTask, backend: Backend) -> str:
    h = hashlib.sha256(f"{BUILD_VERSION}/{backend.name}\n".encode())
    context = task.dockerfile.parent
    for p in sorted(context.rglob("*")):
        if p.is_file():
            h.update(f"{p.relative_to(context)}\n".encode() + p.read_bytes() + b"\n")
    return h.hexdigest()[:20]


def _copy(context: Path, layer: Path, root: str, sources: tuple[str, ...], dest: str) -> None:
    """COPY `sources` (relative to `context`) to `dest` (absolute in the sandbox, under `root`)."""
    inside = layer / dest[len(root) :].lstrip("/") if dest.rstrip("/") != root else layer
    many = len(sources) > 1 or dest.endswith("/")
    for source in sources:
        src = context / source
        if src.is_dir():  # Docker copies a directory's contents
            shutil.copytree(src, inside, dirs_exist_ok=True, symlinks=True)
        else:
            target = inside / src.name if many or inside.is_dir() else inside
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


async def _run_steps(task: HarborTask, plan: BuildPlan, work: Path, backend: Backend) -> None:
    layers = [work / "layers" / str(i) for i in range(len(plan.roots))]
    for layer in layers:
        layer.mkdir(parents=True)
    owner = sandbox_owner(backend)
    open_to_all(work, owner)
    box = None
    deadline = time.monotonic() + task.build_timeout_s
    try:
        for step in plan.steps:
            where = f"harbor task {task.task_id}: Dockerfile:{step.line}: {step.text[:80]}"
            if step.kind == "WORKDIR":
                root = _root_of(plan, step.args[0])
                if root is not None:
                    (layers[plan.roots.index(root)] / step.args[0][len(root) :].lstrip("/")).mkdir(
                        parents=True, exist_ok=True
                    )
            elif step.kind == "COPY":
                root = _root_of(plan, step.args[-1])
                assert root is not None  # dockerfile.py refuses a COPY outside a layer root
                layer = layers[plan.roots.index(root)]
                _copy(task.dockerfile.parent, layer, root, step.args[:-1], step.args[-1])
            else:  # RUN, in the build sandbox
                if box is None:
                    mounts = tuple(
                        Mount(str(d), r, writable=True) for d, r in zip(layers, plan.roots, strict=True)
                    )
                    limits = Limits(
                        timeout_s=task.build_timeout_s,
                        cpu_s=int(task.build_timeout_s),
                        memory_mb=max(task.memory_mb, 1024),
                        pids=512,
                        output_bytes=1 << 20,
                    )
                    box = await backend.create(plan.profile, limits, mounts=mounts)
                exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in step.env)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DockerfileError(
                        f"{where}: the build passed build_timeout_sec ({task.build_timeout_s} s)"
                    )
                result = await box.exec(
                    script=f"set -e\n{exports}mkdir -p {shlex.quote(step.workdir)} 2>/dev/null || true\n"
                    f"cd {shlex.quote(step.workdir)}\n{step.args[0]}\n",
                    timeout=left,
                )
                if not result.ok:
                    tail = (result.stderr or result.stdout).strip()[-400:]
                    raise DockerfileError(
                        f"{where}: failed at build ({result.status}, exit {result.exit_code}; builds are "
                        f"offline and write only under {', '.join(plan.roots) or 'no layer root'}): {tail}"
                    )
            open_to_all(work / "layers", owner)
    finally:
        if box is not None:
            await box.close()


def _root_of(plan: BuildPlan, path: str) -> str | None:
    return next((r for r in plan.roots if path == r or path.startswith(r + "/")), None)


async def build_environment(task: HarborTask, backend: Backend) -> BuiltEnv:
    """`task`'s environment for `backend`, built on first use (DockerfileError naming the line
    that cannot be honoured or failed)."""
    plan = read_dockerfile(task.dockerfile)
    key = await asyncio.to_thread(_key, task, backend)
    root = cache_root() / "envs" / key
    lock = _locks.setdefault(key, asyncio.Lock())
    async with lock:
        record = root / "build.json"
        hit = record.is_file()
        if not hit:
            started = time.perf_counter()
            # built where the sandboxes' user can enter (the cache may sit in a closed home)
            work = Path(tempfile.mkdtemp(prefix=f"palaestra-harbor-build-{key}-"))
            os.chmod(work, 0o755)
            try:
                await _run_steps(task, plan, work, backend)
                shutil.rmtree(root, ignore_errors=True)
                root.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(work, root)
                record.write_text(  # last: a build cut short has none
                    json.dumps({"build_s": round(time.perf_counter() - started, 3), "task": task.task_id})
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
        build_s = json.loads(record.read_text())["build_s"]
    workdir = task.workdir or plan.workdir
    return BuiltEnv(root, tuple(plan.roots), plan.profile, workdir, dict(plan.env), build_s, hit)
