"""Build the sandbox images offline, once: every tag is a hash of what went into it, so a build whose
inputs did not change finds its image and returns at once.

    palaestra sandbox build-images                 # python (sandbox) + server (compose fleet)
    python -m palaestra.sandbox.images.build python --force

Layers (all local, nothing pulled):

    palaestra/sandbox-base:<key>     ``docker import`` of rootfs.py's tar (host python, sh, coreutils)
    palaestra/sandbox-python:<key>   python.Dockerfile: the in-container runner, user 10001
    palaestra/sandbox-server:<key>   server.Dockerfile: the exec server + its Python packages

Each image is also tagged ``:latest``, which is what docker-compose.yml names.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from palaestra.sandbox.images import rootfs

__all__ = ["IMAGES", "REPOSITORY", "ensure_base", "ensure_image"]

HERE = Path(__file__).resolve().parent
REPOSITORY = "palaestra/sandbox"
"""Image names are ``{REPOSITORY}-{name}:{key}``."""

SERVER_PACKAGES = ("fastapi", "uvicorn", "httpx", "aiohttp")
"""Distributions the exec server image carries (with their dependencies), copied from the
environment that runs the build."""


def _python_context(ctx: Path) -> None:
    shutil.copy(HERE / "runner.py", ctx / "runner.py")


def _server_context(ctx: Path) -> None:
    _python_context(ctx)
    site = ctx / "site-packages"
    for dist in _closure(SERVER_PACKAGES):
        for entry in dist.files or []:
            src = Path(dist.locate_file(entry)).resolve()
            rel = Path(str(entry))
            if rel.is_absolute() or ".." in rel.parts or not src.is_file() or "__pycache__" in rel.parts:
                continue
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, site / rel)
    _copy_libraries(site, ctx / "root")
    # The package itself: only its sandbox folder and an empty root (the rest needs torch).
    pkg = site / "palaestra"
    shutil.copytree(HERE.parent, pkg / "sandbox", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (pkg / "__init__.py").write_text(
        '"""Palaestra (the sandbox part only, as the exec server image carries it)."""\n'
    )


def _copy_libraries(tree: Path, out: Path) -> None:
    """The host's shared libraries that compiled modules under ``tree`` load (e.g. libgcc_s for
    pydantic_core), mirrored under ``out`` at their host paths (the Dockerfile copies it to /)."""
    elves = [str(p) for p in tree.rglob("*.so*") if rootfs.is_elf(str(p))]
    fs = rootfs.Rootfs()
    for lib in rootfs.libraries(elves):
        if not lib.startswith(str(tree)):
            rootfs.add(fs, lib)
    for path, src in fs.files.items():
        dest = out / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest)
    for path, target in fs.links.items():
        dest = out / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            dest.symlink_to(target)
    out.mkdir(parents=True, exist_ok=True)


def _closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The distributions ``names`` need, transitively (extras and platform markers not taken)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            head = req.split(";")[0].strip()
            for stop in "<>=!~[ (":
                head = head.split(stop)[0]
            todo.append(head)
    return list(found.values())


@dataclass(frozen=True)
class ImageSpec:
    dockerfile: str
    fill_context: Callable[[Path], None]


IMAGES: dict[str, ImageSpec] = {
    "python": ImageSpec("python.Dockerfile", _python_context),
    "server": ImageSpec("server.Dockerfile", _server_context),
}
"""Buildable images by name; sandbox profiles map to these (profile "python" -> image "python")."""


def _exists(client: Any, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def _log(msg: str) -> None:
    print(f"[sandbox images] {msg}", file=sys.stderr, flush=True)


def ensure_base(client: Any, force: bool = False) -> str:
    """The imported root filesystem's tag, importing it if this content was never imported."""
    fs = rootfs.collect()
    tag = f"{REPOSITORY}-base:{fs.key()}"
    if not force and _exists(client, tag):
        return tag
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="palaestra-rootfs-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        fs.write_tar(tar)
        repo, key = tag.split(":")
        client.api.import_image_from_file(str(tar), repository=repo, tag=key)
    _log(f"imported {tag} ({len(fs.files)} files) in {time.monotonic() - start:.1f} s")
    return tag


def ensure_image(client: Any, name: str, force: bool = False) -> str:
    """The tag of image ``name`` (a key of IMAGES), building it and its base only if missing."""
    if name not in IMAGES:
        raise ValueError(f"unknown sandbox image {name!r}; known: {', '.join(IMAGES)}")
    spec = IMAGES[name]
    base = ensure_base(client, force=force)
    with tempfile.TemporaryDirectory(prefix=f"palaestra-{name}-") as tmp:
        ctx = Path(tmp)
        spec.fill_context(ctx)
        shutil.copy(HERE / spec.dockerfile, ctx / "Dockerfile")
        tag = f"{REPOSITORY}-{name}:{_tree_hash(ctx, base)}"
        if not force and _exists(client, tag):
            client.images.get(tag).tag(f"{REPOSITORY}-{name}", "latest")
            return tag
        start = time.monotonic()
        # network_mode none: the build never needs a network and must not reach one.
        client.images.build(
            path=str(ctx),
            tag=tag,
            buildargs={"BASE": base},
            rm=True,
            forcerm=True,
            pull=False,
            network_mode="none",
        )
    client.images.get(tag).tag(f"{REPOSITORY}-{name}", "latest")
    _log(f"built {tag} in {time.monotonic() - start:.1f} s")
    return tag


def _tree_hash(ctx: Path, base: str) -> str:
    h = hashlib.sha256(base.encode())
    for root, dirs, files in os.walk(ctx):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            h.update(str(path.relative_to(ctx)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="*", default=["python", "server"], help=f"which: {', '.join(IMAGES)}")
    parser.add_argument("--force", action="store_true", help="rebuild even when the tagged image exists")


def run(args: argparse.Namespace) -> int:
    import docker

    client = docker.from_env()
    for name in args.images:
        start = time.monotonic()
        tag = ensure_image(client, name, force=args.force)
        print(f"{name}: {tag} ({time.monotonic() - start:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
