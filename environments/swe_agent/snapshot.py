"""Repository snapshots as plain data, and the diffs between them.

A `Snapshot` maps a relative path to the file's bytes. It is read from a git repository at a commit
(``git archive``) or from a plain directory, written out as the agent's copy (a git repository whose
only commit is the snapshot, so no history can hold the fix), packed as a tar for a sandbox, and
compared or patched with unified diffs in the format ``git diff`` writes and ``git apply`` reads.
Patches are applied here, in Python, so grading needs neither git nor patch inside the sandbox.
"""

from __future__ import annotations

import difflib
import io
import os
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

Snapshot = dict[str, bytes]

SKIP_DIRS = {".git", "__pycache__", ".pytest_cache"}


class PatchError(ValueError):
    """A patch is malformed or does not apply; the message names the file and hunk."""


def _git(*args: str, cwd: str | Path | None = None, input: bytes | None = None) -> bytes:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "palaestra",
        "GIT_AUTHOR_EMAIL": "palaestra@localhost",
        "GIT_COMMITTER_NAME": "palaestra",
        "GIT_COMMITTER_EMAIL": "palaestra@localhost",
        "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    }
    done = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def read_directory(root: str | Path) -> Snapshot:
    root = Path(root)
    out: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            path = Path(dirpath) / name
            out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def read_git(repo: str | Path, commit: str) -> Snapshot:
    """The tree of ``commit`` in the git repository ``repo``."""
    data = _git("archive", "--format=tar", commit, cwd=repo)
    return unpack_tar(data)


def unpack_tar(data: bytes) -> Snapshot:
    out: Snapshot = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                parts = Path(member.name).parts
                if any(p in SKIP_DIRS for p in parts) or member.name.endswith(".pyc"):
                    continue
                out[Path(member.name).as_posix().removeprefix("./")] = tar.extractfile(member).read()
    return out


def pack_tar(files: Snapshot, extra_dir: str | Path | None = None) -> bytes:
    """A gzipped tar of ``files`` (and, with ``extra_dir``, that directory's ``.git``)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 946684800
            tar.addfile(info, io.BytesIO(data))
        if extra_dir is not None and (Path(extra_dir) / ".git").exists():
            tar.add(Path(extra_dir) / ".git", arcname=".git")
    return buffer.getvalue()


def write_directory(files: Snapshot, root: str | Path) -> None:
    root = Path(root)
    for path, data in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def agent_copy_tar(files: Snapshot) -> bytes:
    """The agent's copy: ``files`` in a git repository whose only commit is this snapshot."""
    with tempfile.TemporaryDirectory(prefix="palaestra-swe-copy-") as tmp:
        write_directory(files, tmp)
        _git("init", "-q", "-b", "main", cwd=tmp)
        _git("add", "-A", cwd=tmp)
        _git("commit", "-q", "-m", "snapshot", cwd=tmp)
        return pack_tar(files, extra_dir=tmp)


# ------------------------------------------------------------------------------------ diffs


def diff_snapshots(before: Snapshot, after: Snapshot) -> str:
    """A unified diff (git style: ``a/``/``b/`` paths, ``/dev/null`` for added or removed files)."""
    chunks = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        try:
            old_lines = (old or b"").decode().splitlines(keepends=True)
            new_lines = (new or b"").decode().splitlines(keepends=True)
        except UnicodeDecodeError:
            continue  # binary files are not part of a text patch
        fix = [_terminate(lines) for lines in (old_lines, new_lines)]
        body = list(
            difflib.unified_diff(
                fix[0],
                fix[1],
                "/dev/null" if old is None else f"a/{path}",
                "/dev/null" if new is None else f"b/{path}",
                n=3,
            )
        )
        chunks.append(f"diff --git a/{path} b/{path}\n" + "".join(body))
    return "".join(chunks)


def _terminate(lines: list[str]) -> list[str]:
    if lines and not lines[-1].endswith("\n"):
        return [*lines[:-1], lines[-1] + "\n\\ No newline at end of file\n"]
    return lines


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def patch_paths(patch: str) -> set[str]:
    """The files a patch touches."""
    return {path for path, _, _ in _parse(patch)}


def _parse(patch: str) -> list[tuple[str, bool, list[tuple[int, list[str]]]]]:
    """(path, deleted, hunks); each hunk is (old start, lines with their ' ', '-', '+' prefixes)."""
    files = []
    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- ") or i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            i += 1
            continue
        old = line[4:].strip().split("\t")[0]
        new = lines[i + 1][4:].strip().split("\t")[0]
        deleted = new == "/dev/null"
        name = old if deleted else new
        path = name[2:] if name.startswith(("a/", "b/")) else name
        if not path or path.startswith("/") or ".." in Path(path).parts:
            raise PatchError(f"bad file path in patch: {name!r}")
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            if not match:
                raise PatchError(f"{path}: malformed hunk header {lines[i].strip()!r}")
            old_len = int(match.group(2) or 1)
            new_len = int(match.group(4) or 1)
            start = int(match.group(1))
            i += 1
            body: list[str] = []
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith("\\")):
                text = lines[i]
                if text.startswith("\\"):  # "\ No newline at end of file" belongs to the line before
                    if body:
                        body[-1] = body[-1].rstrip("\n")
                    i += 1
                    continue
                tag = text[:1] if text[:1] in " -+" else (" " if text in ("\n", "\r\n") else None)
                if tag is None:
                    raise PatchError(f"{path}: unexpected line in hunk: {text[:60]!r}")
                payload = text[1:] if text[:1] in " -+" else text
                body.append(tag + payload)
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            hunks.append((start, body))
        files.append((path, deleted, hunks))
    return files


def apply_patch(files: Snapshot, patch: str, fuzz_lines: int = 50) -> Snapshot:
    """``files`` with ``patch`` applied; raises `PatchError` when a hunk's context is not found
    within ``fuzz_lines`` lines of where the hunk says it is."""
    out = dict(files)
    for path, deleted, hunks in _parse(patch):
        if deleted:
            if path not in out:
                raise PatchError(f"{path}: the patch deletes a file that does not exist")
            del out[path]
            continue
        try:
            text = out[path].decode() if path in out else ""
        except UnicodeDecodeError:
            raise PatchError(f"{path}: cannot patch a binary file") from None
        lines = text.splitlines(keepends=True)
        offset = 0
        for number, (start, body) in enumerate(hunks, 1):
            old = [b[1:] for b in body if b[0] in " -"]
            new = [b[1:] for b in body if b[0] in " +"]
            guess = max(start - 1 + offset, 0) if old else max(start + offset, 0)
            if not old and start == 0:
                guess = 0
            at = _find(lines, old, guess, fuzz_lines)
            if at is None:
                raise PatchError(f"{path}: hunk {number} does not apply")
            lines[at : at + len(old)] = new
            offset += len(new) - len(old)
        out[path] = "".join(lines).encode()
    return out


def _find(lines: list[str], old: list[str], guess: int, fuzz: int) -> int | None:
    for delta in range(fuzz + 1):
        for at in (guess - delta, guess + delta):
            if 0 <= at <= len(lines) - len(old) and lines[at : at + len(old)] == old:
                return at
    return None
