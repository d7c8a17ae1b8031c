"""A task's ``environment/Dockerfile`` read into the steps we can build offline, or refused naming
the line that cannot be honoured.

    plan = read_dockerfile(task.dockerfile)      # BuildPlan: profile, steps, layer roots, env
    # DockerfileError: "Dockerfile:3: FROM node:20: no offline image for 'node' (... maps to ...)"

No registry is reachable, so ``FROM`` never pulls: a base image is mapped to a sandbox profile built
offline from this host (sandbox/images: python3, a POSIX shell, bash, coreutils, git, patch...):

    python*, debian*, ubuntu*, buildpack-deps*, bash*  ->  the "python" profile

What the image adds is kept in *layer roots*: host directories mounted writable in the sandbox at
the top directories the Dockerfile writes (``/app``; two levels under /opt, /srv, /home, /var, /mnt,
/run: ``/opt/tool``). ``WORKDIR`` and ``COPY``/``ADD`` (files from the task's ``environment/``
context) act on them on the host; ``RUN`` runs in a build sandbox that mounts them (so a RUN that
writes elsewhere, such as ``apt-get install`` into /usr, fails, naming its line). ``ENV`` and ``ARG``
defaults are kept for every later step and for the agent's and verifier's commands.

Ignored (they start nothing we need: the sandbox runs each command itself): ``CMD``,
``ENTRYPOINT``, ``EXPOSE``, ``LABEL``, ``MAINTAINER``, ``STOPSIGNAL``, ``USER`` (every command
runs as the sandbox's one unprivileged user). Refused: a second ``FROM`` (multi-stage),
``COPY --from``, ``ADD`` of a URL or an archive, ``VOLUME``, ``HEALTHCHECK``, ``ONBUILD``,
``SHELL``, and any write under a directory the sandbox owns (/usr, /etc, /tmp, /work, ...).
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from palaestra.sandbox.base import RESERVED_MOUNT_ROOTS

__all__ = ["FROM_IMAGES", "BuildPlan", "DockerfileError", "Step", "layer_root", "read_dockerfile"]

FROM_IMAGES = {
    "python": "python",
    "debian": "python",
    "ubuntu": "python",
    "buildpack-deps": "python",
    "bash": "python",
}
"""A FROM image's name (registry and tag dropped) -> the sandbox profile built offline in its place."""
IGNORED = ("CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "USER")
REFUSED = {
    "VOLUME": "volumes are the runtime's; write the files into the image instead",
    "HEALTHCHECK": "nothing runs in the sandbox before the agent",
    "ONBUILD": "no image is built from this one",
    "SHELL": "RUN steps run with /bin/sh",
}
SHARED_TOPS = ("opt", "srv", "home", "var", "mnt", "run")
"""Top directories that hold several things: a layer root is one level below them."""
OURS = ("/logs", "/tests", "/solution")
"""Harbor's own paths, mounted by the trial (the Dockerfile may create them; that is dropped)."""


class DockerfileError(ValueError):
    """A Dockerfile step we cannot honour: ``Dockerfile:LINE: INSTRUCTION ...: why``."""


@dataclass(frozen=True)
class Step:
    line: int
    kind: str
    """WORKDIR, COPY or RUN."""
    text: str
    """The instruction as written (for errors)."""
    args: tuple[str, ...]
    """WORKDIR: (path,); COPY: (source, ..., dest); RUN: (shell command,)."""
    workdir: str
    env: tuple[tuple[str, str], ...]
    """The ENV/ARG values in force at this step."""


@dataclass
class BuildPlan:
    profile: str
    base: str
    """The FROM image as written."""
    steps: list[Step] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)
    """The layer roots, in order of first use."""
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)


def layer_root(path: str) -> str | None:
    """The layer root holding absolute `path`, or None when `path` is one of Harbor's own or a
    directory the plan need not keep (``/``, a bare shared top). Raises ValueError for a path the
    sandbox owns."""
    path = posixpath.normpath(path)
    for owned in RESERVED_MOUNT_ROOTS:
        if path == owned or path.startswith(owned + "/"):
            raise ValueError(f"{path} is under {owned}, which the sandbox owns")
    parts = path.strip("/").split("/")
    if path == "/" or any(path == o or path.startswith(o + "/") for o in OURS):
        return None
    if parts[0] in SHARED_TOPS:
        return None if len(parts) < 2 else f"/{parts[0]}/{parts[1]}"
    return f"/{parts[0]}"


def _lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    current, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if not current:
            start = number
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append((start, (current + line).strip()))
        current = ""
    if current.strip():
        out.append((start, current.strip()))
    return out


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m[1] or m[3], m[2] if m[2] is not None else ""), text)


def _pairs(rest: str) -> list[tuple[str, str]]:
    """ENV/ARG ``k=v k2="v 2"`` or the legacy ``ENV k v``."""
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) if "=" in w else (w, "") for w in words]  # type: ignore[misc]


def read_dockerfile(path: Path) -> BuildPlan:
    """The build plan of the Dockerfile at `path` (its context: the directory it is in)."""
    plan: BuildPlan | None = None
    env: dict[str, str] = {}
    workdir = "/"
    for number, text in _lines(path.read_text()):
        keyword, _, rest = text.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        where = f"Dockerfile:{number}: {text[:80]}"

        def refuse(why: str) -> None:
            raise DockerfileError(f"{where}: {why}")  # noqa: B023 (raised at once)

        if keyword == "FROM":
            if plan is not None:
                refuse("a second FROM (multi-stage builds are not supported: one stage)")
            image = _expand(rest.split()[0] if rest else "", env)
            name = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
            if name not in FROM_IMAGES:
                known = ", ".join(f"{k}*" for k in FROM_IMAGES)
                refuse(f"no offline image for {name!r} ({known} map to the sandbox's python profile)")
            plan = BuildPlan(FROM_IMAGES[name], image)
            continue
        if keyword == "ARG":
            for key, value in _pairs(rest):
                env.setdefault(key, _expand(value, env))
            continue
        if plan is None:
            refuse("comes before FROM")
        if keyword in IGNORED:
            continue
        if keyword in REFUSED:
            refuse(REFUSED[keyword])
        if keyword == "ENV":
            for key, value in _pairs(rest):
                env[key] = plan.env[key] = _expand(value, env)
            continue
        if keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, _expand(rest, env)))
            args: tuple[str, ...] = (workdir,)
            touched = [workdir]
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(rest)
            if words and words[0].startswith("["):
                words = json.loads(rest)
            flags = [w for w in words if w.startswith("--")]
            words = [_expand(w, env) for w in words if not w.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                refuse("COPY --from (multi-stage builds are not supported)")
            if len(words) < 2:
                refuse(f"{keyword} needs a source and a destination")
            sources, dest = words[:-1], words[-1]
            if keyword == "ADD" and any(
                re.match(r"^[a-z]+://", s) or re.search(r"\.(tar|tgz|gz|bz2|xz|zip)$", s) for s in sources
            ):
                refuse("ADD of a URL or an archive (no network; an archive is not unpacked): COPY files")
            for source in sources:
                resolved = (path.parent / source).resolve()
                if not resolved.is_relative_to(path.parent.resolve()) or not resolved.exists():
                    refuse(f"source {source!r} is not in the task's environment/ context")
            slash = dest.endswith("/") or posixpath.basename(dest) in (".", "..")
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            slash = slash or dest in plan.roots  # a directory already: copied into
            if dest.count("/") == 1 and not slash and not (path.parent / sources[0]).is_dir():
                refuse(f"copies a file to {dest} directly under /: copy into a folder such as /app")
            args = (*sources, dest + "/" if slash and dest != "/" else dest)
            touched = [dest]
            keyword = "COPY"
        elif keyword == "RUN":
            command = rest
            if rest.startswith("["):
                command = shlex.join(json.loads(rest))
            args, touched = (command,), [workdir]
        else:
            refuse(f"unknown instruction {keyword}")
        for target in touched:
            try:
                root = layer_root(target)
            except ValueError as exc:
                refuse(f"{exc}: the image's files must live elsewhere (e.g. /app)")
            if root is None and keyword == "COPY":
                refuse(f"copies into {target} directly: copy into a folder such as /app")
            if root is not None and root not in plan.roots:
                plan.roots.append(root)
        plan.steps.append(Step(number, keyword, text, args, workdir, tuple(env.items())))
    if plan is None:
        raise DockerfileError(f"{path}: no FROM line")
    plan.workdir = workdir
    return plan
