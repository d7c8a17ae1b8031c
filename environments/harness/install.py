"""Harness binaries, pinned and cached: `palaestra harness install NAME[@VERSION]`.

Each harness is an npm package (`HARNESSES`) installed with `npm install --prefix` into
`cache_dir()/NAME@VERSION` (`$PALAESTRA_HARNESS_CACHE`, default `~/.cache/palaestra/harnesses`).
Once installed it runs offline: Claude Code's package carries its native binary (glibc) as an
optional dependency, Codex's its static musl binary. `native` finds that binary and the folder a
sandbox mounts for it: the harness environment runs it directly, without the npm launcher (a node
script for Codex), so a sandbox needs no node. `make install` installs the pinned versions; `binary` finds an
installed one, or None (the tests that drive them then skip, saying which command installs it).
`shared_root` gives an install at a path every user can enter, which a sandbox run by another user
(uid 65534 when root starts it) can mount: the cache itself, or a hard-linked copy of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HARNESSES",
    "Harness",
    "binary",
    "cache_dir",
    "install",
    "install_root",
    "native",
    "register",
    "shared_root",
]


@dataclass(frozen=True)
class Harness:
    name: str
    package: str
    version: str
    """The pinned version (`make install` installs it; NAME@VERSION picks another)."""
    bin: str
    """The command the package installs under node_modules/.bin."""
    native_dir: str
    """The folder, under node_modules, of the platform package's native binary (``{arch}``: npm's
    name of this machine's architecture, ``{machine}``: the kernel's)."""
    native_bin: str
    """The native binary's path inside `native_dir`."""


HARNESSES = {
    # Claude Code's launcher (.bin/claude) is a hard link of the platform package's binary.
    "claude-code": Harness(
        "claude-code",
        "@anthropic-ai/claude-code",
        "2.1.328",
        "claude",
        "@anthropic-ai/claude-code-linux-{arch}",
        "claude",
    ),
    # Codex's launcher (.bin/codex) is a node script that execs vendor/<triple>/bin/codex; the
    # binary finds its helpers (codex-path/rg, codex-resources/) beside it, in the same folder.
    "codex": Harness(
        "codex",
        "@openai/codex",
        "0.169.0",
        "codex",
        "@openai/codex-linux-{arch}/vendor/{machine}-unknown-linux-musl",
        "bin/codex",
    ),
}
_NPM_ARCH = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def cache_dir() -> Path:
    return Path(os.environ.get("PALAESTRA_HARNESS_CACHE") or Path.home() / ".cache/palaestra/harnesses")


def _split(spec: str) -> tuple[Harness, str]:
    name, _, version = spec.partition("@")
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {name!r}: one of {', '.join(sorted(HARNESSES))}")
    harness = HARNESSES[name]
    return harness, version or harness.version


def binary(spec: str) -> Path | None:
    """The installed binary of `spec` (NAME or NAME@VERSION, default the pinned version), or None."""
    harness, version = _split(spec)
    path = cache_dir() / f"{harness.name}@{version}" / "node_modules" / ".bin" / harness.bin
    return path if path.exists() else None


def install_root(spec: str) -> Path | None:
    """The folder `spec` is installed in (`binary` is `node_modules/.bin/<bin>` below it), or None."""
    harness, version = _split(spec)
    return cache_dir() / f"{harness.name}@{version}" if binary(spec) is not None else None


def native(root: Path, name: str) -> tuple[Path, str]:
    """(the folder to mount, the binary's path inside it) of harness `name`'s native binary in
    the install at `root` (`install_root` or `shared_root`). Raises RuntimeError when the install
    has none for this machine (npm skipped the platform package)."""
    harness = HARNESSES[name]
    machine = platform.machine()
    folder = (
        root
        / "node_modules"
        / harness.native_dir.format(arch=_NPM_ARCH.get(machine, machine), machine=machine)
    )
    if not (folder / harness.native_bin).is_file():
        raise RuntimeError(
            f"{root} has no native {harness.name} binary for {machine} at {folder / harness.native_bin}: "
            f"reinstall it (`palaestra harness install {root.name}`)"
        )
    return folder, harness.native_bin


def _open_to_all(path: Path) -> bool:
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def shared_root(spec: str) -> Path:
    """The install of `spec` at a path every user can enter: its cache folder if it is one (the
    cache outside a closed home), else a hard-linked copy (no space; a copy across filesystems) in
    ``<tmp>/palaestra-harnesses-<uid>/``, made once. Raises RuntimeError when it is not installed."""
    harness, version = _split(spec)
    source = install_root(spec)
    if source is None:
        raise RuntimeError(
            f"{harness.name}@{version} is not installed: run `palaestra harness install {harness.name}@{version}`"
        )
    if _open_to_all(source):
        return source
    shared = Path(tempfile.gettempdir()) / f"palaestra-harnesses-{os.geteuid()}"
    try:
        shared.mkdir(mode=0o755)
    except FileExistsError:
        pass
    info = os.lstat(shared)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RuntimeError(
            f"{shared} is not a directory of this user's: remove it, or set PALAESTRA_HARNESS_CACHE"
        )
    os.chmod(shared, 0o755)
    target = shared / source.name
    if not (target / "node_modules" / ".bin" / harness.bin).exists():
        partial = Path(tempfile.mkdtemp(prefix=source.name + ".", suffix=".partial", dir=shared))
        shutil.copytree(source, partial / "tree", symlinks=True, copy_function=_link_or_copy)
        try:
            (partial / "tree").rename(target)
        except OSError:  # another process made it first
            pass
        shutil.rmtree(partial, ignore_errors=True)
    return target


def install(spec: str, quiet: bool = False) -> Path:
    """Installs `spec` from npm (nothing to do when it is in the cache); returns its binary."""
    harness, version = _split(spec)
    found = binary(f"{harness.name}@{version}")
    if found is not None:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH: install Node.js (>= 20) to install harnesses")
    prefix = cache_dir() / f"{harness.name}@{version}"
    partial = prefix.with_name(prefix.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    cmd = [
        npm,
        "install",
        "--no-audit",
        "--no-fund",
        "--prefix",
        str(partial),
        f"{harness.package}@{version}",
    ]
    done = subprocess.run(cmd, capture_output=quiet, text=True)
    if done.returncode != 0:
        tail = (done.stderr or "")[-2000:] if quiet else ""
        raise RuntimeError(f"npm install {harness.package}@{version} failed ({done.returncode}) {tail}")
    partial.rename(prefix)  # only a whole install is ever found by `binary`
    found = binary(f"{harness.name}@{version}")
    if found is None:
        raise RuntimeError(f"{harness.package}@{version} installed no {harness.bin!r} command")
    return found


def _install(args: argparse.Namespace) -> int:
    specs = args.harness or sorted(HARNESSES)
    for spec in specs:
        try:
            path = install(spec)
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{spec}: {path}")
    return 0


def _path(args: argparse.Namespace) -> int:
    try:
        path = binary(args.harness)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if path is None:
        print(
            f"{args.harness} is not installed: run `palaestra harness install {args.harness}`",
            file=sys.stderr,
        )
        return 1
    print(path)
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    group = groups.add_parser("harness", help="coding-agent harness binaries (Claude Code, Codex)")
    cmds = group.add_subparsers(dest="cmd", metavar="SUBCOMMAND", required=True)
    pinned = ", ".join(f"{h.name}@{h.version}" for h in HARNESSES.values())
    p = cmds.add_parser("install", help=f"install harnesses from npm into the cache (pinned: {pinned})")
    p.add_argument("harness", nargs="*", help="NAME or NAME@VERSION (default: every harness, pinned)")
    p.set_defaults(func=_install)
    p = cmds.add_parser("path", help="print an installed harness's binary (exit 1 if not installed)")
    p.add_argument("harness", help="NAME or NAME@VERSION")
    p.set_defaults(func=_path)
