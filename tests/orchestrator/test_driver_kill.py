"""The driver of `palaestra train` killed with SIGKILL, twice, and the run resumed each time (issue 37).

One run of the `tiny` preset (sync, 3 steps, a checkpoint after each, one engine), launched three
times as `palaestra train CONFIG` in a process group of its own (`start_new_session=True`):

    launch   started as             halted at (`PALAESTRA_TEST_HALT_AT`)   resumes from
    1        fresh                  batch:1       step 2's batch read (its samples spooled), untrained
    2        --resume               checkpoint:1  step 2 trained, its checkpoint not yet saved       step 1
    3        --resume               (runs to the end)                                                step 1

The halt is the driver's TEST HOOK (`train.HALT_ENV`): at that phase of that step the driver writes
`halted` into the run's directory and waits; the test then takes every process descended from it
(Ray's own, the engine's, the gateway's, the router's) and kills the driver's process group with
SIGKILL. Nothing depends on how fast a step runs. Checked:

* no process of a killed driver outlives it (Ray's fate sharing, the servers' lifeline);
* the run finishes: every step once in the final history of the step ledger (`trained.jsonl`),
  the last checkpoint the last step's;
* no sample trained twice, none lost: every sample the gateway spooled, in every launch, is in the
  final history once or recorded as not trained with its reason (a killed launch's samples after
  its checkpoint: `earlier_launch`, read back by the launch that resumed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palaestra.orchestrator.audit import spooled
from tests.support.runs import make_config

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.engine, pytest.mark.timeout(900)]

LAUNCHES = [("batch:1", False), ("checkpoint:1", True), (None, True)]  # (halt, --resume)
WAIT_S = 300.0


def _children() -> dict[int, list[int]]:
    """pid -> its child pids, of every process now."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _launch(
    config: Path, out: Path, halt: str | None, resume: bool, log: Path
) -> subprocess.CompletedProcess | None:
    """One launch of the driver; None when it halted and was killed (every process of it gone)."""
    env = {**os.environ, "RAY_worker_niceness": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("PALAESTRA_TEST_HALT_AT", None)
    if halt is not None:
        env["PALAESTRA_TEST_HALT_AT"] = halt
    argv = [sys.executable, "-m", "palaestra.cli", "train", str(config), *(["--resume"] if resume else [])]
    with open(log, "w") as output:
        driver = subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + WAIT_S
            while driver.poll() is None and not (halt and (out / "halted").is_file()):
                assert time.monotonic() < deadline, (
                    f"the driver neither halted nor ended in {WAIT_S:g} s: {log}"
                )
                time.sleep(0.1)
            if driver.poll() is not None:
                assert halt is None, f"the driver ended ({driver.returncode}) before halting at {halt}: {log}"
                return subprocess.CompletedProcess(argv, driver.returncode)
            family = _descendants(driver.pid)
            os.killpg(driver.pid, signal.SIGKILL)  # the driver's process group, by its id
            driver.wait()
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
    (out / "halted").unlink()
    deadline = time.monotonic() + 60  # the lifeline polls every 0.5 s, then gives 10 s to stop
    while any(_running(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: _cmdline(p) for p in family if _running(p)}
    for p in left:  # never leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes of the driver killed at {halt} still ran 60 s later: {left}"
    return None


def test_a_driver_killed_mid_step_and_mid_checkpoint_resumes_with_no_sample_lost_or_trained_twice(tmp_path):
    from palaestra.config import save_config
    from palaestra.orchestrator.ledger import read_steps

    out = tmp_path / "run"
    cfg = make_config(out, "sync", "engines.count=1", "run.steps=3", "env.eval_tasks=0")
    config = save_config(cfg, tmp_path / "config.yaml")
    started = time.monotonic()
    for i, (halt, resume) in enumerate(LAUNCHES):
        done = _launch(config, out, halt, resume, tmp_path / f"launch-{i + 1}.log")
        print(f"\nlaunch {i + 1} ({halt or 'to the end'}): {time.monotonic() - started:.1f} s")
        if done is not None:
            assert done.returncode == 0, (tmp_path / f"launch-{i + 1}.log").read_text()[-3000:]
    history, reasons = read_steps(out / "trained.jsonl")
    launches = [json.loads(line)["launch"] for line in (out / "trained.jsonl").read_text().splitlines()]
    assert len(set(launches)) == 3  # each launch noted its steps (the first its step 1 only)
    assert sorted(history) == [1, 2, 3] and all(history.values())
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000003"
    trained = [sid for step in sorted(history) for sid in history[step]]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    samples = {s["sample_id"] for s in spooled(out)}
    assert set(trained) <= samples
    lost = samples - set(trained) - set(reasons)
    assert not lost, f"spooled, neither trained nor recorded with a reason: {sorted(lost)}"
    assert not set(trained) & set(reasons)
    assert "earlier_launch" in reasons.values()  # the killed launches' samples after their checkpoints
