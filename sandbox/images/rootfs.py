"""Assemble the sandbox images' base root filesystem from this host's own files, offline.

No registry can be reached where Palaestra is built, so the base image is not pulled: it is a tar
of the host's Python interpreter (its stdlib and extension modules), a POSIX shell, a few dozen
coreutils, every shared library ``ldd`` says they need and the C library's other parts
(``C_LIBRARY``: what a native glibc binary such as Claude Code's links), each at its host path, which
``docker import`` turns into an image. ``build.py`` layers the Dockerfiles on top.

    python -m palaestra.sandbox.images.rootfs /tmp/rootfs.tar     # writes the tar, prints its key

The key hashes what goes in (paths, sizes, mtimes), so a rebuild is skipped when nothing changed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["C_LIBRARY", "SANDBOX_UID", "TOOLS", "Rootfs", "add", "collect", "is_elf", "libraries"]

TOOLS = (
    "sh bash cat ls echo printf sleep head tail wc mkdir rmdir rm cp mv ln env true false id touch "
    "dd yes sort uniq tr cut seq stat df du grep sed setsid kill timeout test chmod pwd tee xargs "
    "find diff cmp basename dirname md5sum sha256sum nproc uname date whoami ps expr awk mkfifo git patch base64"
).split()
"""Commands the images offer besides python3 (those this host lacks are left out)."""

C_LIBRARY = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1")
"""The C library's parts, all of them whichever the tools load: a native binary built against
glibc (Claude Code's) links librt, libdl and libpthread, which python and the tools may not."""
RUNTIME_LIBRARIES = ("libgcc_s.so.1", "libstdc++.so.6")
"""What compiled Python extensions load besides the C library (pydantic-core, in mini-swe-agent's
venv, needs libgcc_s; without it the harness failed to start in a container)."""

SANDBOX_UID = 10001
"""The unprivileged user commands run as (``sandbox``); a uid no host account is likely to have."""

_STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
    "lib2to3", "__phello__", "pydoc_data",
}  # fmt: skip
_MERGED_USR = ("bin", "sbin", "lib", "lib64")  # Debian: /bin -> usr/bin etc.


@dataclass
class Rootfs:
    """What goes into the base image: regular files (image path -> host path) and symlinks."""

    files: dict[str, Path] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    python: str = ""
    """The interpreter's path inside the image (also linked as python3 in /usr/bin and /usr/local/bin)."""

    def key(self) -> str:
        """A hash of every input's path, size and mtime, and of this file's own code."""
        h = hashlib.sha256(Path(__file__).read_bytes())
        for dest in sorted(self.files):
            st = self.files[dest].stat()
            h.update(f"{dest}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        h.update(json.dumps(sorted(self.links.items())).encode())
        return h.hexdigest()[:16]

    def write_tar(self, out: Path) -> None:
        """A deterministic tar: root-owned, normalized modes, the host files' mtimes."""
        dirs = {"/tmp", "/work", "/etc", "/proc", "/sys", "/dev", "/run", "/usr/local/bin", "/opt"}
        for path in list(self.files) + list(self.links):
            parent = os.path.dirname(path)
            while parent not in ("/", ""):
                dirs.add(parent)
                parent = os.path.dirname(parent)
        with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
            for d in sorted(dirs):
                info = tarfile.TarInfo(d.lstrip("/"))
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "/tmp" else 0o755
                tar.addfile(info)
            for path, target in sorted(self.links.items()):
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
            for path, src in sorted(self.files.items()):
                st = src.stat()
                info = tarfile.TarInfo(path.lstrip("/"))
                # Real mtimes: a .pyc is only used while its source's mtime matches the one it records.
                info.size, info.mtime = st.st_size, int(st.st_mtime)
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                with open(src, "rb") as f:
                    tar.addfile(info, f)
            for name, text in _etc_files().items():
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))


def _etc_files() -> dict[str, str]:
    # Commands run as the unprivileged user ``sandbox``; root and nobody exist so that tools asking
    # for names find them.
    return {
        "etc/passwd": (
            "root:x:0:0:root:/root:/bin/sh\n"
            f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/work:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        ),
        "etc/group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "etc/hosts": "127.0.0.1 localhost\n",
        "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }


def _skip_file(name: str) -> bool:
    # Optimized bytecode is never used without -O; Tk would drag in X11.
    return name.endswith((".opt-1.pyc", ".opt-2.pyc")) or name.startswith("_tkinter")


def _image_path(host_path: str) -> str:
    """Where a host file goes in the image: its parent directory resolved (so /lib/x.so lands in
    /usr/lib, as on the host), its own name kept (it may be a symlink we record)."""
    parent, name = os.path.split(os.path.abspath(host_path))
    return os.path.join(os.path.realpath(parent), name)


def add(fs: Rootfs, host_path: str) -> None:
    """Add a host file, following and recording every symlink on the way to the real file."""
    seen = 0
    path = _image_path(host_path)
    while os.path.islink(path) and seen < 16:
        target = os.readlink(path)
        fs.links[path] = target
        path = _image_path(os.path.join(os.path.dirname(path), target))
        seen += 1
    if os.path.isfile(path):
        fs.files[path] = Path(path)


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def libraries(elf_paths: list[str]) -> set[str]:
    """Shared libraries (and the dynamic loader) the given ELF files load, per ``ldd``."""
    libs: set[str] = set()
    for i in range(0, len(elf_paths), 200):
        out = subprocess.run(["ldd", *elf_paths[i : i + 200]], capture_output=True, text=True).stdout
        libs.update(re.findall(r"(?:=> )?(/\S+) \(0x", out))
    return libs


def _python_layout(python: str) -> dict[str, str]:
    code = (
        "import json, sys, sysconfig; print(json.dumps({'exe': sys.executable,"
        " 'stdlib': sysconfig.get_path('stdlib'), 'dynload': sysconfig.get_config_var('DESTSHARED'),"
        " 'version': '%d.%d' % sys.version_info[:2]}))"
    )
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def collect(python: str | None = None) -> Rootfs:
    """Everything the base image needs, found on this host. ``python`` defaults to the system's
    ``/usr/bin/python3.X`` of this interpreter's version (it lives under /usr, where the local
    backend's sandboxes look for it), else the interpreter this process runs on."""
    python = python or default_python()
    layout = _python_layout(python)
    fs = Rootfs()
    exe = os.path.realpath(layout["exe"])
    add(fs, exe)
    fs.python = _image_path(exe)
    for name in ("python3", f"python{layout['version']}"):
        for folder in ("/usr/local/bin", "/usr/bin"):
            if f"{folder}/{name}" != fs.python:
                fs.links[f"{folder}/{name}"] = fs.python
    stdlib = os.path.realpath(layout["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if not (root == stdlib and d in _STDLIB_SKIP) and d != "test")
        if root == stdlib:
            dirs[:] = [d for d in dirs if not d.startswith("config-")]
        for name in files:
            if not _skip_file(name):
                add(fs, os.path.join(root, name))
    dynload = os.path.realpath(layout["dynload"])
    if not dynload.startswith(stdlib + "/"):
        for name in os.listdir(dynload):
            if not _skip_file(name):
                add(fs, os.path.join(dynload, name))
    for tool in TOOLS:
        found = shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if found:
            add(fs, found)
    elves = [str(p) for p in fs.files.values() if is_elf(str(p))]
    found_libs = libraries(elves)
    for lib in sorted(found_libs):
        add(fs, lib)
    libc = next((lib for lib in found_libs if os.path.basename(lib) == "libc.so.6"), None)
    for name in (*C_LIBRARY, *RUNTIME_LIBRARIES) if libc else ():
        if os.path.exists(os.path.join(os.path.dirname(libc), name)):
            add(fs, os.path.join(os.path.dirname(libc), name))
    for top in _MERGED_USR:
        if os.path.islink(f"/{top}"):
            fs.links[f"/{top}"] = os.readlink(f"/{top}")
    # A file and a link for the same path: the link wins only when it points elsewhere.
    for path in [p for p in fs.links if p in fs.files]:
        del fs.links[path]
    return fs


def default_python() -> str:
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if os.path.exists(system):
        return system
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:] or ["rootfs.tar"])[0])
    fs = collect()
    fs.write_tar(out)
    print(f"{out}: {len(fs.files)} files, {len(fs.links)} links, key {fs.key()}, python {fs.python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
