"""tests/support/timeline.py: the summary of a parallel run's timeline names the worker that ended
last, what each worker spent in tests, and the span of the one-at-a-time groups."""

from __future__ import annotations

import random

from tests.support.timeline import summarize


def _run(seed: int) -> tuple[list[dict], dict[str, tuple[float, float, float]]]:
    """Random tests on two workers after a start at 100.0; per worker (first start, last end, busy)."""
    rng = random.Random(seed)
    records: list[dict] = [{"worker": "main", "event": "start", "t": 100.0}]
    expected = {}
    for worker in ("gw0", "gw1"):
        t = 100.0 + rng.uniform(1, 30)
        first, busy = t, 0.0
        for i in range(rng.randint(1, 8)):
            d = rng.uniform(0, 50)
            group = rng.choice(["ray", "slow", f"tests/m{i}.py"])
            records.append(
                {
                    "worker": worker,
                    "event": "test",
                    "test": f"t{worker}{i}",
                    "group": group,
                    "t0": t,
                    "t1": t + d,
                }
            )
            t, busy = t + d + rng.uniform(0, 2), busy + d
        expected[worker] = (first - 100.0, t - 100.0, busy)
    rng.shuffle(records)
    return records, expected


def test_each_worker_line_has_its_first_start_last_end_time_in_tests_and_idle_at_the_end():
    for seed in range(20):
        records, expected = _run(seed)
        lines = summarize(records)
        ends = {}
        for worker, (first, _, busy) in expected.items():
            row = next(line for line in lines if line.startswith(worker + " ")).split()
            assert float(row[1]) == round(first, 1) and float(row[3]) == round(busy, 1), (row, expected)
            ends[worker] = float(row[2])
            last_end = max(r["t1"] for r in records if r.get("worker") == worker) - 100.0
            assert float(row[2]) == round(last_end, 1)
            assert int(row[5]) == sum(r.get("worker") == worker for r in records)
        for worker in expected:
            row = next(line for line in lines if line.startswith(worker + " ")).split()
            assert abs(float(row[4]) - (max(ends.values()) - ends[worker])) <= 0.11
        ray = [r for r in records if r.get("group") == "ray"]
        if ray:
            line = next(line for line in lines if line.startswith("group ray:"))
            assert line.startswith(f"group ray: {len(ray)} tests on "), line
            assert f"{sum(r['t1'] - r['t0'] for r in ray):.1f} s in tests" in line


def test_nothing_recorded_says_so():
    assert summarize([]) == ["no records"]
    assert summarize([{"worker": "main", "event": "start", "t": 1.0}]) == ["no tests recorded"]
