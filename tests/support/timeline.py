"""Where a parallel test run's wall time went: each worker's tests, in order, with their start and
end (`PALAESTRA_TEST_TIMELINE=FILE pytest -n 2 ...`), and a summary of them
(`python -m tests.support.timeline FILE`).

`--durations` says how long each test took, not on which worker or when, so it cannot tell the
critical path of `make test` (the worker that ends last, and what it ran) from the total work. With
the variable set, every worker (and a run without xdist, as `main`) appends one JSON line per test
to FILE: its worker, node id, xdist group, and the wall-clock start and end of its setup, call and
teardown together; plus one line per worker when its session starts (before collection) and
ends. Lines are appended whole by one `write` each, so the workers share the file. Nothing is
recorded without the variable (tests/conftest.py loads this module as a plugin).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable

import pytest

ENV = "PALAESTRA_TEST_TIMELINE"


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _append(record: dict) -> None:
    path = os.environ.get(ENV)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    _append({"worker": _worker(), "event": "start", "t": time.time()})


def pytest_sessionfinish(session: pytest.Session) -> None:
    _append({"worker": _worker(), "event": "end", "t": time.time()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    began = time.time()
    yield
    if os.environ.get(ENV):
        mark = item.get_closest_marker("xdist_group")
        group = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark is not None else None
        _append(
            {
                "worker": _worker(),
                "event": "test",
                "test": item.nodeid.split("@")[0],
                "group": group,
                "t0": began,
                "t1": time.time(),
            }
        )


def summarize(records: Iterable[dict], *, last: int = 5) -> list[str]:
    """The lines `python -m tests.support.timeline` prints: per worker, seconds from the first
    worker's start to its first test, to its last test's end, the seconds spent in tests, and its
    idle seconds before the last worker ends; then the span of each group that ran one test at a
    time (ray, docker, slow) and each worker's last `last` tests."""
    records = list(records)
    if not records:
        return ["no records"]
    zero = min(r["t"] if "t" in r else r["t0"] for r in records)
    tests: dict[str, list[dict]] = {}
    for r in records:
        if r["event"] == "test":
            tests.setdefault(r["worker"], []).append(r)
    if not tests:
        return ["no tests recorded"]
    end_of_all = max(t["t1"] for ts in tests.values() for t in ts) - zero
    lines = [f"{'worker':8} {'first test':>10} {'last end':>9} {'in tests':>9} {'idle at end':>11} tests"]
    for worker in sorted(tests):
        ts = sorted(tests[worker], key=lambda t: t["t0"])
        first, end = ts[0]["t0"] - zero, ts[-1]["t1"] - zero
        busy = sum(t["t1"] - t["t0"] for t in ts)
        lines.append(f"{worker:8} {first:10.1f} {end:9.1f} {busy:9.1f} {end_of_all - end:11.1f} {len(ts)}")
    groups: dict[str, list[dict]] = {}
    for ts in tests.values():
        for t in ts:
            groups.setdefault(t["group"] or "?", []).append(t)
    for name in ("ray", "docker", "slow"):
        if name in groups:
            g = groups[name]
            span0, span1 = min(t["t0"] for t in g) - zero, max(t["t1"] for t in g) - zero
            busy = sum(t["t1"] - t["t0"] for t in g)
            workers = ",".join(sorted({t["worker"] for t in g}))
            lines.append(
                f"group {name}: {len(g)} tests on {workers}, {span0:.1f}-{span1:.1f} s, {busy:.1f} s in tests"
            )
    for worker in sorted(tests):
        ts = sorted(tests[worker], key=lambda t: t["t0"])[-last:]
        lines.append(f"{worker} ends with:")
        lines += [f"  {t['t0'] - zero:7.1f} {t['t1'] - t['t0']:6.1f} s  {t['test']}" for t in ts]
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.timeline FILE (written by PALAESTRA_TEST_TIMELINE=FILE pytest)")
        return 2
    with open(argv[0]) as f:
        print("\n".join(summarize(json.loads(line) for line in f if line.strip())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
