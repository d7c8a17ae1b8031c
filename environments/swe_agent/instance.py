"""SWE task instances in SWE-bench's shape, and the JSONL they are stored in.

One JSON object per line, with SWE-bench's field names plus ``test_cmd``:

- ``instance_id``: unique name;
- ``repo``: a local path (absolute, or relative to the JSONL file) to a git repository or a plain
  directory;
- ``base_commit``: the commit of ``repo`` the task starts from ("" for a plain directory);
- ``problem_statement``: what the agent is told;
- ``patch``: the reference fix (unified diff against the base, without the tests);
- ``test_patch``: the tests that grade (unified diff); they are *not* in the agent's copy;
- ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: test ids that must go from failing to passing / keep passing
  (a list, or a JSON-encoded list as SWE-bench's own files have it);
- ``test_cmd``: "python3 -m unittest" (ids are dotted unittest names) or a command that prints
  pytest's ``-rA`` summary (ids are pytest node ids).

Optional: ``bug_kind`` and ``source`` (the generator's), ``hints_text`` (ignored).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from palaestra.environments.swe_agent.snapshot import Snapshot, read_directory, read_git

UNITTEST = "python3 -m unittest"


class InstanceError(ValueError):
    """A malformed instance; the message names the field (and the line of the JSONL)."""


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    test_cmd: str = UNITTEST
    bug_kind: str = ""
    source: str = "jsonl"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def task_id(self) -> str:
        return self.instance_id

    def base(self) -> Snapshot:
        """The files of the starting point, before ``test_patch``: what the agent's copy holds."""
        path = Path(self.repo)
        if self.repo.startswith(("image:", "docker://")) or self.extra.get("image"):
            raise InstanceError(
                f"{self.instance_id}: 'repo' {self.repo!r} is an image; only local repositories are supported yet"
            )
        if not path.exists():
            raise InstanceError(f"{self.instance_id}: 'repo' {self.repo!r} does not exist")
        if self.base_commit:
            return read_git(path, self.base_commit)
        return read_directory(path)

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("extra")
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = list(self.FAIL_TO_PASS), list(self.PASS_TO_PASS)
        return row


STRING_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")


def _test_list(row: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = row.get(key)
    if isinstance(value, str):  # SWE-bench stores these as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InstanceError(f"{where}: {key!r} is a string but not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise InstanceError(f"{where}: {key!r} must be a list of test ids")
    return tuple(value)


def instance_from_json(row: Any, base_dir: str | Path = ".", where: str = "instance") -> SweInstance:
    if not isinstance(row, dict):
        raise InstanceError(f"{where}: expected a JSON object")
    for key in STRING_FIELDS:
        if not isinstance(row.get(key), str):
            raise InstanceError(f"{where}: {key!r} must be a string")
    if not row["instance_id"]:
        raise InstanceError(f"{where}: 'instance_id' must not be empty")
    f2p = _test_list(row, "FAIL_TO_PASS", where)
    if not f2p:
        raise InstanceError(f"{where}: 'FAIL_TO_PASS' must name at least one test")
    test_cmd = row.get("test_cmd", UNITTEST)
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise InstanceError(f"{where}: 'test_cmd' must be a non-empty string")
    repo = row["repo"]
    if not Path(repo).is_absolute() and not repo.startswith(("image:", "docker://")):
        repo = str((Path(base_dir) / repo).resolve())
    known = {*STRING_FIELDS, "FAIL_TO_PASS", "PASS_TO_PASS", "test_cmd", "bug_kind", "source"}
    return SweInstance(
        instance_id=row["instance_id"],
        repo=repo,
        base_commit=row["base_commit"],
        problem_statement=row["problem_statement"],
        patch=row["patch"],
        test_patch=row["test_patch"],
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=_test_list(row, "PASS_TO_PASS", where) if "PASS_TO_PASS" in row else (),
        test_cmd=test_cmd,
        bug_kind=str(row.get("bug_kind", "")),
        source=str(row.get("source", "jsonl")),
        extra={k: v for k, v in row.items() if k not in known},
    )


def load_jsonl(path: str | Path) -> list[SweInstance]:
    """Every instance of a JSONL file; raises `InstanceError` naming the line and field."""
    path = Path(path)
    out, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: not JSON ({exc.msg})") from None
        instance = instance_from_json(row, path.parent, where)
        if instance.instance_id in seen:
            raise InstanceError(f"{where}: duplicate instance_id {instance.instance_id!r}")
        seen.add(instance.instance_id)
        out.append(instance)
    return out


def write_jsonl(
    instances: list[SweInstance], path: str | Path, relative_to: str | Path | None = None
) -> None:
    """Writes instances; with ``relative_to``, repo paths under it are stored relative to it."""
    with open(path, "w") as f:
        for instance in instances:
            row = instance.to_json()
            if relative_to is not None:
                try:
                    row["repo"] = str(Path(instance.repo).resolve().relative_to(Path(relative_to).resolve()))
                except ValueError:
                    pass
            f.write(json.dumps(row) + "\n")
