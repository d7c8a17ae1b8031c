"""`kill -9` of one process in the middle of a `palaestra train` run, and the run survives it.

One test per box: an engine, the router, the gateway, the environment runner (the RolloutWorker
actor's process), a trainer rank. Each runs the `tiny` preset for 3 sync steps (2 tasks x 2 samples
of tests/orchestrator/test_train_e2e.py's two-turn environment, 2 s between the turns; a checkpoint after every
step) and SIGKILLs the real OS process while step 2's episodes are in flight (the moment is chosen
by watching the environment runner's groups; the kill is a real `os.kill`). Each asserts:

* the run finishes every step, each step once in the final history (a trainer death redoes the
  steps after the last checkpoint: the trainer test checkpoints every 2 steps of 4 and dies in
  step 4, so step 3 is undone and redone);
* no sample is trained twice, and none is lost: every sample the gateway spooled for the run is
  trained, or recorded as not trained with its reason (failed / aborted sessions, groups abandoned
  because of the fault, steps undone by a trainer restart);
* no token of one session appears in another: each spooled sample's prompt names its own task and
  no other, and each session's samples belong to one group;
* the report lists the fault (component, action, recovery time), in `faults.json`, the summary
  line and `faults/*` counters in metrics.jsonl. The recovery time is printed (docs/reliability-faults.md).

They are slow (~1-2 min each on 2 cores; a Ray per module): run them one at a time, e.g.
`.venv/bin/python -m pytest -q -p no:cacheprovider -s tests/orchestrator/test_faults.py -k engine`.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.orchestrator.test_train_e2e import make_config, ray_local  # noqa: F401 (the module's Ray, below)

pytestmark = pytest.mark.usefixtures("ray_local")
STEPS = 3


def _kill_during_generation(cluster, pid: int, killed: list[float]) -> threading.Thread:
    """SIGKILLs `pid` once the environment runner has groups in flight (and their sessions had a
    moment to start talking), from a thread: the driver is inside the step meanwhile."""
    import ray

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if ray.get(cluster.rollout.status.remote(), timeout=10)["in_flight_groups"]:
                    break
            except ray.exceptions.RayError:
                pass
            time.sleep(0.05)
        time.sleep(0.5)  # first turns answered, episodes in their pause (TwoTurnEnv)
        os.kill(pid, signal.SIGKILL)
        killed.append(time.time())

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _pid(name: str, cluster) -> int:
    import ray

    if name == "runner":
        return ray.get(cluster.rollout.info.remote(), timeout=30)["pid"]
    if name == "trainer":
        return ray.get(cluster.trainer[0].ready.remote(), timeout=30)["pid"]
    box = {"engine": cluster.engines[1] if cluster.engines[1:] else None, "router": cluster.router}.get(
        name, cluster.gateway
    )
    return ray.get(box.actor.pid.remote(), timeout=30)


def run_with_a_kill(
    tmp_path: Path, target: str, *extra: str, steps: int = STEPS, after: int = 1, mode: str = "sync"
):
    """A `steps`-step run in which `target`'s process is SIGKILLed during the generation of the
    step after step `after` (1-based)."""
    from palaestra.train import train

    killed: list[float] = []
    threads: list[threading.Thread] = []

    def on_step(step: int, cluster) -> None:
        if step + 1 == after and not threads:  # the trainer is idle here (its pid answers)
            threads.append(_kill_during_generation(cluster, _pid(target, cluster), killed))

    cfg = make_config(
        tmp_path / target,
        mode,
        # two turns 2 s apart: every episode is in flight for a while, so the kill lands inside one
        "env.name=test_train_e2e:TwoTurnEnv",
        "env.args={pause_s: 2}",
        f"run.steps={steps}",
        "env.eval_tasks=0",
        "run.max_restarts=1",
        *extra,
    )
    result = train(cfg, on_step=on_step)
    threads[0].join(timeout=5)
    assert killed, f"{target} was never killed"
    return result, killed[0]


def spooled(out: Path) -> list[dict]:
    """Every sample the gateway made durable in this run (its spool segments)."""
    samples = []
    for segment in sorted((out / "spool").glob("samples-*.jsonl")):
        samples += [json.loads(line)["sample"] for line in segment.read_text().splitlines() if line]
    return samples


def check_run(result, component: Callable[[str], bool], killed_at: float, steps: int = STEPS) -> dict:
    """The assertions every fault shares; returns the fault."""
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    out = result.output_dir
    # The run finished, each step once in the final history.
    assert result.state.step == steps
    assert [r.step for r in result.trained] == list(range(steps))
    assert result.engine_versions_end == [str(steps)] * 2

    # No sample trained twice; none lost.
    trained = [sid for r in result.trained for sid in r.sample_ids]
    assert len(trained) == len(set(trained))
    samples = [s for s in spooled(out) if not s["group_id"].rsplit("/", 1)[-1].startswith("eval-")]
    assert set(trained) <= {s["sample_id"] for s in samples}
    not_trained = result.not_trained or {}
    unaccounted = [
        (s["sample_id"], s["group_id"], s["status"])
        for s in samples
        if s["sample_id"] not in set(trained) | set(not_trained)
    ]
    assert not unaccounted, f"spooled, neither trained nor recorded with a reason: {unaccounted}"
    assert not set(trained) & set(not_trained)
    assert all(isinstance(r, str) and r for r in not_trained.values())

    # No token of one session in another: a sample's prompt names its own task (and no other),
    # and a session's samples stay in one group.
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    groups: dict[str, set[str]] = {}
    for s in samples:
        prompt = tokenizer.decode(s["tokens"][: s["prompt_len"]])
        named = re.findall(r"task (count-\d+-\d+)", prompt)
        assert named and set(named) == {s["task_id"]}, (s["session_id"], s["task_id"], prompt)
        groups.setdefault(s["session_id"], set()).add(s["group_id"])
    assert all(len(g) == 1 for g in groups.values())

    # The report lists the fault.
    faults = [f for f in result.faults or [] if component(f["component"])]
    assert len(faults) == 1, result.faults
    fault = faults[0]
    assert math.isfinite(fault["recovery_s"]) and fault["recovery_s"] > 0 and fault["action"]
    assert json.loads((out / "faults.json").read_text()) == result.faults
    assert "faults: " + fault["component"] in result.summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("faults/") for r in rows for k in r)
    print(
        f"\n{fault['component']}: killed {time.strftime('%H:%M:%S', time.gmtime(killed_at))}, "
        f"noticed during {fault['phase']}, {fault['action']}; recovery {fault['recovery_s']:.1f} s; "
        f"not trained: {sorted(set(not_trained.values()))}"
    )
    return fault


@pytest.mark.slow
def test_a_killed_engine_is_restarted_with_the_current_weights(tmp_path):
    result, killed = run_with_a_kill(tmp_path, "engine")
    fault = check_run(result, lambda c: c == "engine-1", killed)
    assert "restarted on the same port" in fault["action"] and "weight version 1 loaded" in fault["action"]


@pytest.mark.slow
def test_a_killed_router_is_restarted_on_its_port(tmp_path):
    result, killed = run_with_a_kill(tmp_path, "router")
    fault = check_run(result, lambda c: c == "router", killed)
    assert "restarted on the same port" in fault["action"]


@pytest.mark.slow
def test_a_killed_gateway_is_restarted_on_its_port_and_spool(tmp_path):
    result, killed = run_with_a_kill(tmp_path, "gateway")
    fault = check_run(result, lambda c: c == "gateway", killed)
    assert "restarted on the same port" in fault["action"]


@pytest.mark.slow
def test_a_killed_environment_runner_is_replaced_and_its_groups_redone(tmp_path):
    result, killed = run_with_a_kill(tmp_path, "runner")
    fault = check_run(result, lambda c: c == "environment runner", killed)
    assert "replaced" in fault["action"] and "generation redone" in fault["action"]
    assert "runner_died" in set((result.not_trained or {}).values()) or "aborted" in fault["action"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_overlapping_modes_survive_a_killed_environment_runner(tmp_path, mode):
    """Generation overlaps training (one-step-off: step k+1's while step k trains; async: a
    continuous stream): the runner dies with it in flight, the stream or the next step's groups
    are started again from the run's task position."""
    opts = ("trainer.keep_old_actor=true",) if mode == "one_step_off" else ("trainer.use_tis=true",)
    result, killed = run_with_a_kill(tmp_path, "runner", *opts, mode=mode)
    check_run(result, lambda c: c == "environment runner", killed)
    assert all(lag <= 1 for r in result.trained for lag in r.lags)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_trainer_resumes_from_the_last_checkpoint_and_redoes_the_steps_after_it(tmp_path, mode):
    """Checkpoints after steps 2 and 4; the trainer dies during step 4's generation, so step 3
    (trained, not checkpointed) is undone and redone: its first samples never count as trained."""
    steps = 4
    opts = ("run.checkpoint_every=2", *(["trainer.use_tis=true"] if mode == "async" else []))
    result, killed = run_with_a_kill(tmp_path, "trainer", *opts, steps=steps, after=3, mode=mode)
    fault = check_run(result, lambda c: c == "trainer", killed, steps)
    assert "resumed from step-000002" in fault["action"]
    undone = [sid for sid, why in (result.not_trained or {}).items() if why == "trainer_restart"]
    assert len(undone) >= 4  # step 3's batch (2 tasks x 2 samples), maybe step 4's too
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 3, 4]  # step 3 logged twice
