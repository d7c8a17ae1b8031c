"""orchestrator/audit.py without a run: the books of a small spool and history, each way they can
fail to balance named, and a spool missing a segment refused (test_faults.py runs it on real runs)."""

from __future__ import annotations

import json
import types

import pytest

from palaestra.orchestrator.audit import audit_run, fault_kind, spooled


def _spool(out, *segments: list[tuple[str, str]]) -> None:
    spool = out / "spool"
    spool.mkdir(parents=True)
    cursor = 0
    for number, samples in enumerate(segments, start=1):
        lines = []
        for sid, group in samples:
            cursor += 1
            sample = {"sample_id": sid, "group_id": f"env/t/{group}", "status": "completed"}
            lines.append(json.dumps({"cursor": cursor, "sample": sample}))
        (spool / f"samples-{number:06d}.jsonl").write_text("\n".join(lines) + "\n")


def _result(out, trained: list[list[str]], not_trained: dict[str, str]):
    steps = [types.SimpleNamespace(sample_ids=ids) for ids in trained]
    return types.SimpleNamespace(output_dir=out, trained=steps, not_trained=not_trained)


def test_balanced_books(tmp_path):
    _spool(tmp_path, [("a", "r.0"), ("b", "r.0")], [("c", "r.1"), ("e", "eval-0.0")])
    audit = audit_run(_result(tmp_path, [["a"], ["b"]], {"c": "zero_variance"}))
    assert audit.problems() == [] and (audit.generated, audit.trained) == (3, 2)
    assert audit.line() == (
        "3 samples generated, 2 trained, 1 not trained (zero_variance 1); 0 lost, 0 trained twice"
    )


def test_every_way_the_books_do_not_balance_is_named(tmp_path):
    _spool(tmp_path, [("a", "r.0"), ("b", "r.0"), ("c", "r.0"), ("d", "r.0")])
    audit = audit_run(_result(tmp_path, [["a", "x"], ["a", "b"]], {"b": "stale", "d": ""}))
    problems = audit.problems()
    assert [p.split(":")[0] for p in problems] == [
        "1 trained twice",
        "1 spooled, neither trained nor recorded with a reason",
        "1 trained, never spooled",
        "1 trained and recorded as not trained",
        "1 recorded as not trained without a reason",
    ], problems
    assert audit.lost == [("c", "env/t/r.0", "completed")]


def test_a_spool_missing_a_segment_is_refused_not_read_as_lost(tmp_path):
    _spool(tmp_path, [("a", "r.0")], [("b", "r.0")])
    (tmp_path / "spool" / "samples-000001.jsonl").unlink()  # acknowledged and deleted
    with pytest.raises(ValueError, match=r"holds spool segments \[2\]: acknowledged ones were deleted"):
        spooled(tmp_path)


def test_fault_kinds():
    """The books read the counters the run writes: a node's death is `faults/engine_node`."""
    components = ("engine-3", "environment runner", "gateway", "node of engine-1", "host of engine-0")
    assert [fault_kind(c) for c in components] == [
        "engine",
        "environment_runner",
        "gateway",
        "engine_node",
        "engine_host",
    ]
