"""Harness binaries, pinned and cached: `palaestra harness install NAME[@VERSION]`.

Each harness (`HARNESSES`, a name → `Harness` mapping) is installed into
`cache_dir()/NAME@VERSION` (`$PALAESTRA_HARNESS_CACHE`, default `~/.cache/palaestra/harnesses`)
from its registry, and runs offline afterwards:

- npm (`npm install --prefix`): Claude Code's package carries its native binary (glibc) as an
  optional dependency, Codex's its static musl binary, OpenCode's its bun-compiled binary;
- PyPI (a venv of the sandbox's Python, /usr/bin/python3, under `venv/`, filled by this
  interpreter's pip): mini-swe-agent, whose venv is mounted read-only and run by its own
  `bin/python` (the venv's interpreter is a link to /usr/bin/python3, which every sandbox has);
- ours (``registry="palaestra"``): the Terminus-style agent, a stdlib program in this package's
  `terminus/` folder, which is its install (nothing to download; run by the sandbox's python3).

`native` finds the binary and the folder a sandbox mounts for it: the harness environment runs it
directly, without the npm launcher (a node script for Codex), so a sandbox needs no node. `make
install` installs the pinned versions; `binary` finds an installed one, or None (the tests that
drive them then skip, saying which command installs it). `shared_root` gives an install at a path
every user can enter, which a sandbox run by another user (uid 65534 when root starts it) can
mount: the cache itself, or a hard-linked copy of it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
    """The folder, inside the install, of the platform package's native binary (``{arch}``: npm's
    name of this machine's architecture, ``{machine}``: the kernel's); a venv for PyPI harnesses."""
    native_bin: str
    """The native binary's path inside `native_dir`."""
    registry: str = "npm"
    """Where it installs from: "npm" (into node_modules/), "pypi" (into a venv, venv/) or
    "palaestra" (ours: its folder in this package is the install, at the one version there is)."""
    address_space_mb: int | None = None
    """The address space (RLIMIT_AS, `Limits.address_space_mb`) its sandbox allows, MiB, when its
    runtime reserves more than the sandbox's memory; None: the memory limit."""

    def address_space(self, memory_mb: int) -> int | None:
        """`Limits.address_space_mb` of its sandbox with `memory_mb` of memory: `address_space_mb`
        (the memory when that is larger), or None (the memory limit)."""
        return None if self.address_space_mb is None else max(self.address_space_mb, memory_mb)

    @property
    def launcher(self) -> str:
        """The command's path inside the install."""
        return {"npm": f"node_modules/.bin/{self.bin}", "pypi": f"venv/bin/{self.bin}"}.get(
            self.registry, self.bin
        )


HARNESSES = {
    # Claude Code's launcher (.bin/claude) is a hard link of the platform package's binary.
    "claude-code": Harness(
        "claude-code",
        "@anthropic-ai/claude-code",
        "2.1.328",
        "claude",
        "node_modules/@anthropic-ai/claude-code-linux-{arch}",
        "claude",
    ),
    # Codex's launcher (.bin/codex) is a node script that execs vendor/<triple>/bin/codex; the
    # binary finds its helpers (codex-path/rg, codex-resources/) beside it, in the same folder.
    "codex": Harness(
        "codex",
        "@openai/codex",
        "0.169.0",
        "codex",
        "node_modules/@openai/codex-linux-{arch}/vendor/{machine}-unknown-linux-musl",
        "bin/codex",
    ),
    # OpenCode's launcher (.bin/opencode) is a node script that finds the platform package's
    # binary (a bun-compiled executable, glibc; npm also installs the -baseline one for older CPUs).
    # Its JavaScriptCore reserves address space by the GiB: at a 4,096 MiB RLIMIT_AS its heap
    # cannot grow ("MemoryExhaustion", exit 132/134, or "Error: Out of memory" once its bash tool
    # runs) with ~600 MiB resident; measured VmPeak 12 GiB at 64 GiB (docs/harnesses.md).
    "opencode": Harness(
        "opencode",
        "opencode-ai",
        "1.18.33",
        "opencode",
        "node_modules/opencode-linux-{arch}/bin",
        "opencode",
        address_space_mb=64 << 10,
    ),
    # mini-swe-agent is Python: the venv is what a sandbox mounts, run as `bin/python -m minisweagent`
    # (the `mini` script's shebang names the host's path of the venv).
    "mini-swe-agent": Harness(
        "mini-swe-agent", "mini-swe-agent", "2.4.6", "mini", "venv", "bin/python", registry="pypi"
    ),
    # Ours, in terminus/: one stdlib script the sandbox's python3 runs (why not Terminus-2 itself:
    # docs/harnesses.md). Its version changes with what the agent does.
    "terminus": Harness("terminus", "palaestra", "1", "agent.py", ".", "agent.py", registry="palaestra"),
}
OURS = Path(__file__).parent
"""Where our own harnesses' folders are (``OURS / name``)."""
SANDBOX_PYTHON = "/usr/bin/python3"
"""The interpreter a PyPI harness's venv is made from: the one every sandbox has (the local
backend's sees the host's /usr; the docker images carry the host's Python at the same path)."""
_NPM_ARCH = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def cache_dir() -> Path:
    return Path(os.environ.get("PALAESTRA_HARNESS_CACHE") or Path.home() / ".cache/palaestra/harnesses")


def _split(spec: str) -> tuple[Harness, str]:
    name, _, version = spec.partition("@")
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {name!r}: one of {', '.join(sorted(HARNESSES))}")
    harness = HARNESSES[name]
    if harness.registry == "palaestra" and version not in ("", harness.version):
        raise ValueError(f"{name} is part of palaestra: its one version is {harness.version}, not {version}")
    return harness, version or harness.version


def _root(harness: Harness, version: str) -> Path:
    if harness.registry == "palaestra":
        return OURS / harness.name
    return cache_dir() / f"{harness.name}@{version}"


def binary(spec: str) -> Path | None:
    """The installed binary of `spec` (NAME or NAME@VERSION, default the pinned version), or None."""
    harness, version = _split(spec)
    path = _root(harness, version) / harness.launcher
    return path if path.exists() else None


def install_root(spec: str) -> Path | None:
    """The folder `spec` is installed in (`binary` is `node_modules/.bin/<bin>` below it), or None."""
    harness, version = _split(spec)
    return _root(harness, version) if binary(spec) is not None else None


def native(root: Path, name: str) -> tuple[Path, str]:
    """(the folder to mount, the binary's path inside it) of harness `name`'s native binary in
    the install at `root` (`install_root` or `shared_root`). Raises RuntimeError when the install
    has none for this machine (npm skipped the platform package)."""
    harness = HARNESSES[name]
    machine = platform.machine()
    folder = root / harness.native_dir.format(arch=_NPM_ARCH.get(machine, machine), machine=machine)
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


BYTECODE_MARK = ".palaestra-bytecode"
"""In a shared copy: the install's bytecode is in it (`_add_bytecode`)."""


def _add_bytecode(source: Path, target: Path) -> None:
    """Hard-links the compiled bytecode (``__pycache__``) of a Python install into its shared copy,
    once (BYTECODE_MARK). The copy is mounted read-only in the sandbox, where Python cannot write
    bytecode: without it every run of a Python harness compiled what it imported from source
    (mini-swe-agent: ~8 s of its ~15 s run, litellm's modules). Links keep the sources' times,
    so the bytecode stays valid; a copy made before this, without it, gets it on its next use."""
    if (target / BYTECODE_MARK).exists():
        return
    for folder, _dirs, files in os.walk(source):
        if os.path.basename(folder) != "__pycache__":
            continue
        dest = target / os.path.relpath(folder, source)
        if not dest.parent.is_dir():
            continue
        dest.mkdir(exist_ok=True)
        for name in files:
            with contextlib.suppress(FileExistsError):  # another process linked it first
                _link_or_copy(os.path.join(folder, name), str(dest / name))
    (target / BYTECODE_MARK).touch()


def shared_root(spec: str) -> Path:
    """The install of `spec` at a path every user can enter: its cache folder if it is one (the
    cache outside a closed home), else a hard-linked copy (no space; a copy across filesystems) in
    ``<tmp>/palaestra-harnesses-<uid>/``, made once, with the install's compiled bytecode (our own
    harnesses' folders in the repository are copied without theirs). Raises RuntimeError when it
    is not installed."""
    harness, version = _split(spec)
    source = install_root(spec)
    if source is None:
        raise RuntimeError(
            f"{harness.name}@{version} is not installed: run `palaestra harness install {harness.name}@{version}`"
        )
    if _open_to_all(source):
        return source
    name = source.name
    if harness.registry == "palaestra":  # named by its content: an edited agent is a new copy
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(source.glob("*.py"))))
        name = f"{harness.name}@{version}-{digest.hexdigest()[:12]}"
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
    target = shared / name
    if not (target / harness.launcher).exists():
        partial = Path(tempfile.mkdtemp(prefix=name + ".", suffix=".partial", dir=shared))
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(source, partial / "tree", symlinks=True, copy_function=_link_or_copy, ignore=ignore)
        if harness.registry != "palaestra":
            _add_bytecode(source, partial / "tree")
        try:
            (partial / "tree").rename(target)
        except OSError:  # another process made it first
            pass
        shutil.rmtree(partial, ignore_errors=True)
    elif harness.registry != "palaestra":
        _add_bytecode(source, target)  # a copy made without it
    return target


def install(spec: str, quiet: bool = False) -> Path:
    """Installs `spec` from its registry (nothing to do when it is in the cache); returns its binary."""
    harness, version = _split(spec)
    found = binary(f"{harness.name}@{version}")
    if found is not None:
        return found
    prefix = cache_dir() / f"{harness.name}@{version}"
    partial = prefix.with_name(prefix.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for cmd in _install_commands(harness, version, partial):
        done = subprocess.run(cmd, capture_output=quiet, text=True)
        if done.returncode != 0:
            tail = (done.stderr or "")[-2000:] if quiet else ""
            raise RuntimeError(
                f"{' '.join(cmd[:3])} ... {harness.package}=={version} failed ({done.returncode}) {tail}"
            )
    partial.rename(prefix)  # only a whole install is ever found by `binary`
    found = binary(f"{harness.name}@{version}")
    if found is None:
        raise RuntimeError(f"{harness.package}@{version} installed no {harness.bin!r} command")
    return found


def _install_commands(harness: Harness, version: str, into: Path) -> list[list[str]]:
    if harness.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is not on PATH: install Node.js (>= 20) to install harnesses")
        return [
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(into), f"{harness.package}@{version}"]
        ]
    if not os.access(SANDBOX_PYTHON, os.X_OK):
        raise RuntimeError(
            f"{SANDBOX_PYTHON} is not there: a PyPI harness's venv is made from the sandbox's Python"
        )
    venv = into / "venv"
    return [
        [SANDBOX_PYTHON, "-m", "venv", "--without-pip", str(venv)],
        [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--quiet",
         "--disable-pip-version-check", f"{harness.package}=={version}"],
    ]  # fmt: skip


def _install(args: argparse.Namespace) -> int:
    specs = args.harness or sorted(HARNESSES)
    failed = 0
    for spec in specs:  # one that cannot be installed (no npm, say) does not stop the others
        try:
            path = install(spec)
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"error: {spec}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{spec}: {path}")
    return 2 if failed else 0


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
    group = groups.add_parser(
        "harness",
        help="coding-agent harnesses (Claude Code, Codex, OpenCode, mini-swe-agent; terminus, ours)",
    )
    cmds = group.add_subparsers(dest="cmd", metavar="SUBCOMMAND", required=True)
    pinned = ", ".join(f"{h.name}@{h.version}" for h in HARNESSES.values())
    p = cmds.add_parser("install", help=f"install harnesses from npm/PyPI into the cache (pinned: {pinned})")
    p.add_argument("harness", nargs="*", help="NAME or NAME@VERSION (default: every harness, pinned)")
    p.set_defaults(func=_install)
    p = cmds.add_parser("path", help="print an installed harness's binary (exit 1 if not installed)")
    p.add_argument("harness", help="NAME or NAME@VERSION")
    p.set_defaults(func=_path)
