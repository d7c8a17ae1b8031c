"""The books of a finished run: every sample the gateway spooled for it trained once, or recorded as
not trained with its reason, and every process death reported once, the same in every report.

    result = train(cfg)
    audit = audit_run(result)
    audit.problems()                                     # [] when the books balance
    report_problems(result, ["engine-1", "gateway"])     # the deaths someone caused, each reported

What balancing means (`Audit.problems`): no sample id twice in the run's history
(`RunResult.trained`), none trained that was never spooled, none both trained and recorded as not
trained, every reason a non-empty name, and no spooled sample of the run's training (evaluation
samples are not) that is neither trained nor recorded with a reason: a lost one. The spool is read
from its segment files: a segment is deleted once a checkpoint acknowledged all its samples and
the spool moved on to the next (64 MiB each), and a spool missing one is refused rather than read
as lost samples.

Used by tests/orchestrator/test_faults.py (defined deaths) and bench/chaos.py (a seeded schedule
of them).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.gateway.sessions.spool import read_segment
from palaestra.orchestrator.supervisor import fault_kind  # the counters' own names (engine_node, ...)

__all__ = ["Audit", "audit_run", "fault_kind", "report_problems", "spooled"]


def spooled(output_dir: Path) -> list[dict]:
    """Every sample the run's gateway (each shard's spool) made durable, as spooled (JSON); a
    ValueError if a spool no longer holds all its segments (numbered from 1)."""
    samples = []
    segments = sorted((Path(output_dir) / "spool").rglob("samples-*.jsonl"))
    for folder in {s.parent for s in segments}:
        numbers = sorted(int(s.stem.split("-")[1]) for s in segments if s.parent == folder)
        if numbers != list(range(1, len(numbers) + 1)):
            raise ValueError(
                f"{folder} holds spool segments {numbers}: acknowledged ones were deleted, so its "
                "samples cannot all be read (a run this long needs larger gateway spool segments)"
            )
    for segment in segments:
        samples += read_segment(segment)  # a fork is stored against its parent: read it whole
    return samples


def _evaluation(sample: dict) -> bool:
    return sample["group_id"].rsplit("/", 1)[-1].startswith("eval-")


@dataclass
class Audit:
    """What a run generated, trained and set aside, and what does not add up."""

    generated: int
    """Samples spooled for the run's training (evaluation samples left out)."""
    trained: int
    """Sample ids in the run's history (`RunResult.trained`), repeats included."""
    not_trained: Counter[str]
    """Spooled samples recorded as not trained, per reason."""
    duplicated: list[str] = field(default_factory=list)
    """Ids trained more than once."""
    lost: list[tuple[str, str, str]] = field(default_factory=list)
    """(sample id, group id, status) spooled, neither trained nor recorded with a reason."""
    unknown: list[str] = field(default_factory=list)
    """Ids trained that the spool never held."""
    both: list[str] = field(default_factory=list)
    """Ids trained and also recorded as not trained."""
    unnamed: list[str] = field(default_factory=list)
    """Ids recorded as not trained without a reason."""

    def problems(self) -> list[str]:
        """Each way the books do not balance, with the first ids; [] when they do."""
        out = []
        for name, ids in (
            ("trained twice", self.duplicated),
            ("spooled, neither trained nor recorded with a reason", self.lost),
            ("trained, never spooled", self.unknown),
            ("trained and recorded as not trained", self.both),
            ("recorded as not trained without a reason", self.unnamed),
        ):
            if ids:
                out.append(f"{len(ids)} {name}: {ids[:5]}")
        return out

    def line(self) -> str:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.not_trained.items())) or "none"
        return (
            f"{self.generated} samples generated, {self.trained} trained, "
            f"{sum(self.not_trained.values())} not trained ({reasons}); "
            f"{len(self.lost)} lost, {len(self.duplicated)} trained twice"
        )


def audit_run(result: Any) -> Audit:
    """The books of `result` (a `RunResult`), from its history, its not-trained record and the spool."""
    trained = [sid for record in result.trained for sid in record.sample_ids]
    trained_set = set(trained)
    samples = [s for s in spooled(result.output_dir) if not _evaluation(s)]
    ids = {s["sample_id"] for s in samples}
    not_trained = result.not_trained or {}
    return Audit(
        generated=len(samples),
        trained=len(trained),
        not_trained=Counter(not_trained[s["sample_id"]] for s in samples if s["sample_id"] in not_trained),
        duplicated=sorted(sid for sid, n in Counter(trained).items() if n > 1),
        lost=[
            (s["sample_id"], s["group_id"], s["status"])
            for s in samples
            if s["sample_id"] not in trained_set and s["sample_id"] not in not_trained
        ],
        unknown=sorted(trained_set - ids),
        both=sorted(trained_set & set(not_trained)),
        unnamed=sorted(sid for sid, why in not_trained.items() if not (isinstance(why, str) and why)),
    )


def report_problems(result: Any, components: Iterable[str]) -> list[str]:
    """How the run's reports disagree with the deaths caused (`components`, one per death): each
    fault in `RunResult.faults` once and nothing else, the same in faults.json, a finite recovery
    and an action for each, each named in the summary line, and the `faults/*` counters of
    metrics.jsonl adding up. [] when they agree."""
    out = Path(result.output_dir)
    faults = result.faults or []
    problems = []
    if sorted(f["component"] for f in faults) != sorted(components):
        problems.append(f"faults {sorted(f['component'] for f in faults)} for deaths {sorted(components)}")
    saved = json.loads((out / "faults.json").read_text())  # an earlier launch's first (a resumed run)
    if saved[len(saved) - len(faults) :] != faults:
        problems.append("faults.json differs from the run's faults")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for fault in faults:
        if not (math.isfinite(fault["recovery_s"]) and fault["recovery_s"] > 0 and fault["action"]):
            problems.append(f"not recovered, or no action: {fault}")
        if f"{fault['component']} at {fault['at'][11:19]} during {fault['phase']}" not in result.summary:
            problems.append(f"not in the summary line: {fault['component']} at {fault['at']}")
    for kind in sorted({fault_kind(f["component"]) for f in faults}):
        counted = sum(r.get(f"faults/{kind}", 0) for r in rows)
        expected = sum(fault_kind(f["component"]) == kind for f in faults)
        if counted != expected:
            problems.append(f"faults/{kind} adds up to {counted} in metrics.jsonl, {expected} faults")
    if faults and max(r.get("faults/total", 0) for r in rows) != len(faults):
        problems.append(f"faults/total is not {len(faults)} in metrics.jsonl")
    return problems
