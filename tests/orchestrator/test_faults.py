"""`kill -9` of the run's processes in the middle of `palaestra train` runs, and the runs survive.

Four runs of the `tiny` preset (2 tasks x 2 samples per step of tests/orchestrator/test_train_e2e.py's two-turn
environment), each SIGKILLing real OS processes (`os.kill`, the pid from the actor) at defined
moments; each test checks one death:

    run           mode          steps (checkpoints)   what dies, and when
    servers       sync          4 (after 2 and 4)     engine-1 mid-episode in step 2, the router mid-episode
                                                      in step 3, the gateway mid-episode in step 4; the
                                                      gateway while the driver checkpoints after step 2
                                                      and at the final checkpoint (the trainer saved,
                                                      the spool not told yet)
    sync          sync          4 (after 2 and 4)     the environment runner mid-episode in step 2; a
                                                      trainer rank once step 4's batch is read (step 3,
                                                      trained but not checkpointed, is undone and redone)
    async         async         4 (after 2 and 4)     the same two
    one_step_off  one_step_off  3 (every step)        the environment runner mid-episode in step 3's
                                                      generation (which runs while step 2 trains)

The moments never depend on how fast a step runs. Mid-episode: the environment's gate holds a
task's sessions between their two turns (`TwoTurnEnv(gate=..., gated=...)`); once all of them wait
there the process is killed, and the gate opens only once the driver has seen the death (a server
restarted and its recovery done, the runner replaced). The checkpoint and batch moments are the
run's own hook (`train(cfg, hook=...)`, `orchestrator/loop.py`'s `PHASES`): in the driver's thread,
the process is killed and gone before the driver goes on, and its next call meets the death.

Each test asserts, for its run (`check_run`):

* the run finishes every step, each step once in the final history, every engine at the last version;
* no sample is trained twice, and none is lost: every sample the gateway spooled for the run is
  trained, or recorded as not trained with its reason (failed / aborted sessions, groups abandoned
  because of a fault, steps undone by a trainer restart);
* no token of one session appears in another: each spooled sample's prompt names its own task and
  no other, and each session's samples belong to one group;
* every kill is reported, once: each fault (component, action, recovery time) in `faults.json`, the
  summary line and `faults/*` counters in metrics.jsonl, and no fault that no kill explains;

and, for its death, what was done about it. The recovery times are printed (docs/reliability-faults.md).

A run is a module fixture, started by the first test that needs it and shared by its tests (~1 min
each on 2 cores; one Ray for the module). One run alone, e.g.:
`.venv/bin/python -m pytest -q -p no:cacheprovider -s tests/orchestrator/test_faults.py -k engine`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import TWO_TURN, make_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.engine,
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.timeout(1200),  # a run's first test carries the whole run (its fixture)
]

COMPONENT = {
    "engine": "engine-1",
    "router": "router",
    "gateway": "gateway",
    "runner": "environment runner",
    "trainer": "trainer",
}
SERVERS = ("engine", "router", "gateway")
SAMPLES_PER_TASK = 2  # make_config's env.samples_per_task
WAIT_S = 300.0  # for a gate's sessions, or for the driver to see a death: a hang ends, explained


@dataclass
class Kill:
    """One planned death: `target` killed at task `task`'s gate, or at the run's hook phase `at`."""

    target: str
    task: int | None = None
    at: tuple[str, int] | None = None  # (phase, step) of `loop.PHASES`, the step 0-based
    pid: int = 0
    killed_at: float = math.nan  # time.time()
    nth: int = 0  # the component's faults before this one: its fault is the nth of the component

    @property
    def component(self) -> str:
        return COMPONENT[self.target]

    def where(self) -> str:
        return (
            f"task {self.task}'s gate" if self.task is not None else f"{self.at[0]} of step {self.at[1] + 1}"
        )


def _pid(target: str, cluster) -> int:
    import ray

    if target == "runner":
        return ray.get(cluster.rollout.info.remote(), timeout=60)["pid"]
    if target == "trainer":
        return ray.get(cluster.trainer[0].ready.remote(), timeout=60)["pid"]
    box = {"engine": cluster.engines[1], "router": cluster.router, "gateway": cluster.gateway}[target]
    return ray.get(box.actor.pid.remote(), timeout=60)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts: its sockets are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _until(done: Callable[[], bool], what: str, stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            raise AssertionError(f"gave up waiting {WAIT_S:g} s for {what}")
        time.sleep(0.05)


class Killer:
    """Carries out a run's `Kill`s: the hook's in the driver's thread, the gates' in a thread of
    its own (started at the run's first hook call, which hands it the `Run`)."""

    def __init__(self, gate: Path, kills: list[Kill]):
        self.gate, self.kills = gate, kills
        gate.mkdir(parents=True)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def env_args(self) -> str:
        gated = [k.task for k in self.kills if k.task is not None]
        return f"env.args={{pause_s: 0.2, gate: '{self.gate}', gated: {gated}}}"

    def hook(self, phase: str, step: int, run) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._gates, args=(run,), daemon=True)
            self.thread.start()
        for kill in self.kills:
            if kill.at == (phase, step) and not kill.pid:  # once: a trainer rollback replays phases
                self._kill(kill, run)
                _until(lambda pid=kill.pid: _gone(pid), f"{kill.component} (pid {kill.pid}) to exit")

    def _kill(self, kill: Kill, run) -> None:
        kill.pid = _pid(kill.target, run.cluster)
        kill.nth = sum(f.component == kill.component for f in run.supervisor.faults)
        os.kill(kill.pid, signal.SIGKILL)
        kill.killed_at = time.time()

    def _seen(self, kill: Kill, run) -> bool:
        """The driver has noticed the death: a server restarted (its recovery done), the runner replaced."""
        faults = [f for f in run.supervisor.faults if f.component == kill.component]
        if len(faults) <= kill.nth:
            return False
        fault = faults[kill.nth]
        return math.isfinite(fault.recovery_s) if kill.target in SERVERS else bool(fault.action)

    def _gates(self, run) -> None:
        try:
            for kill in [k for k in self.kills if k.task is not None]:
                _until(
                    lambda t=kill.task: len(list(self.gate.glob(f"arrived-{t}-*"))) >= SAMPLES_PER_TASK,
                    f"task {kill.task}'s sessions at the gate",
                    self.stop,
                )
                self._kill(kill, run)
                _until(
                    lambda k=kill: self._seen(k, run), f"the driver to see {kill.component} die", self.stop
                )
                (self.gate / f"open-{kill.task}").touch()
        except Exception as exc:  # noqa: BLE001 (reported by the test, with the run's outcome)
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:  # never leave a session waiting
            for kill in self.kills:
                if kill.task is not None:
                    (self.gate / f"open-{kill.task}").touch()

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)


@dataclass
class Outcome:
    """A finished run and its kills."""

    result: Any
    kills: list[Kill]
    steps: int
    checked: bool = False
    notes: list[str] = field(default_factory=list)

    def fault(self, kill: Kill) -> dict:
        """The fault `kill` caused, after the run's checks (`check_run`)."""
        if not self.checked:
            check_run(self)
            self.checked = True
        fault = [f for f in self.result.faults if f["component"] == kill.component][kill.nth]
        print(
            f"\n{fault['component']} killed at {kill.where()} "
            f"({time.strftime('%H:%M:%S', time.gmtime(kill.killed_at))}), noticed during {fault['phase']}: "
            f"{fault['action']}; recovery {fault['recovery_s']:.1f} s; "
            f"not trained: {sorted(set((self.result.not_trained or {}).values()))}"
        )
        return fault

    def kill(self, target: str, **where) -> Kill:
        (kill,) = [
            k for k in self.kills if k.target == target and all(getattr(k, a) == v for a, v in where.items())
        ]
        return kill


# ----------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------
RUNS: dict[str, tuple[str, int, list[Kill], tuple[str, ...]]] = {
    # name: (mode, steps, kills, overrides)
    "servers": (
        "sync",
        4,
        [
            Kill("engine", task=2),
            Kill("router", task=4),
            Kill("gateway", task=6),
            Kill("gateway", at=("checkpoint_saved", 1)),
            Kill("gateway", at=("checkpoint_saved", 3)),  # the final checkpoint
        ],
        ("run.checkpoint_every=2", "run.max_restarts=3"),
    ),
    "sync": (
        "sync",
        4,
        [Kill("runner", task=2), Kill("trainer", at=("batch", 3))],
        ("run.checkpoint_every=2", "run.max_restarts=1"),
    ),
    "async": (
        "async",
        4,
        [Kill("runner", task=2), Kill("trainer", at=("batch", 3))],
        ("run.checkpoint_every=2", "run.max_restarts=1", "trainer.tis.enabled=true"),
    ),
    "one_step_off": (
        "one_step_off",
        3,
        [Kill("runner", task=4)],
        ("run.max_restarts=1", "trainer.keep_old_actor=true"),
    ),
}


def run_with_kills(out: Path, name: str) -> Outcome:
    from palaestra.train import train

    mode, steps, kills, extra = RUNS[name]
    kills = [Kill(k.target, k.task, k.at) for k in kills]  # fresh records for this run
    killer = Killer(out / "gate", kills)
    cfg = make_config(
        out / name,
        mode,
        f"env.name={TWO_TURN}",
        killer.env_args(),
        f"run.steps={steps}",
        "env.eval_tasks=0",
        *extra,
    )
    try:
        result = train(cfg, hook=killer.hook)
    finally:
        killer.finish()
    assert not killer.errors, killer.errors
    missed = [k.where() for k in kills if not k.pid]
    assert not missed, f"{name}: never killed at {missed}"
    return Outcome(result, kills, steps)


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory) -> Callable[[str], Outcome]:
    """`runs(name)`: the run `name` of `RUNS`, started by the first test that asks for it."""
    done: dict[str, Outcome | BaseException] = {}

    def get(name: str) -> Outcome:
        if name not in done:
            try:
                done[name] = run_with_kills(tmp_path_factory.mktemp(name), name)
            except Exception as exc:  # its other tests fail with the same cause, without a rerun
                done[name] = exc
                raise
        outcome = done[name]
        if isinstance(outcome, BaseException):
            pytest.fail(f"the {name!r} run failed: {type(outcome).__name__}: {outcome}")
        return outcome

    return get


# ----------------------------------------------------------------------------------------------
# What every run must show
# ----------------------------------------------------------------------------------------------
@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def check_run(outcome: Outcome) -> None:
    """The assertions every run shares; the books and the reports are `orchestrator/audit.py`'s."""
    from palaestra.orchestrator.audit import audit_run, report_problems, spooled

    result, steps = outcome.result, outcome.steps
    # The run finished, each step once in the final history.
    assert result.state.step == steps
    assert [r.step for r in result.trained] == list(range(steps))
    assert result.engine_versions_end == [str(steps)] * 2

    # No sample trained twice; none lost.
    problems = audit_run(result).problems()
    assert not problems, problems

    # No token of one session in another: a sample's prompt names its own task (and no other),
    # and a session's samples stay in one group.
    groups: dict[str, set[str]] = {}
    for s in spooled(result.output_dir):
        if s["group_id"].rsplit("/", 1)[-1].startswith("eval-"):
            continue
        prompt = _tokenizer().decode(s["tokens"][: s["prompt_len"]])
        named = re.findall(r"task (count-\d+-\d+)", prompt)
        assert named and set(named) == {s["task_id"]}, (s["session_id"], s["task_id"], prompt)
        groups.setdefault(s["session_id"], set()).add(s["group_id"])
    assert all(len(g) == 1 for g in groups.values())

    # Every kill is reported once, and nothing else died.
    problems = report_problems(result, [k.component for k in outcome.kills])
    assert not problems, problems


# ----------------------------------------------------------------------------------------------
# The servers: restarted in place
# ----------------------------------------------------------------------------------------------
def test_a_killed_engine_is_restarted_with_the_current_weights(runs):
    run = runs("servers")
    fault = run.fault(run.kill("engine"))
    assert fault["phase"] == "generation"
    assert "restarted on the same port" in fault["action"] and "weight version 1 loaded" in fault["action"]


def test_a_killed_router_is_restarted_on_its_port(runs):
    run = runs("servers")
    fault = run.fault(run.kill("router"))
    assert fault["phase"] == "generation" and "restarted on the same port" in fault["action"]


def test_a_killed_gateway_is_restarted_on_its_port_and_spool(runs):
    """Its sessions were open between their turns: the journal brings them back, none is lost."""
    run = runs("servers")
    fault = run.fault(run.kill("gateway", task=6))
    assert fault["phase"] == "generation" and "restarted on the same port" in fault["action"]
    assert "lost" not in fault["action"]
    assert "gateway_restart" not in set((run.result.not_trained or {}).values())


ACK = "acknowledging the checkpoint to the gateway's spool"


def test_a_gateway_killed_while_the_driver_checkpoints_is_restarted_and_the_run_goes_on(runs):
    """Killed once the trainer saved step 2's checkpoint, before the driver tells the spool: the
    acknowledgement meets the dead gateway, which is restarted, and the acknowledgement is made again."""
    run = runs("servers")
    fault = run.fault(run.kill("gateway", at=("checkpoint_saved", 1)))
    assert fault["phase"] == ACK and "restarted on the same port" in fault["action"]
    assert (run.result.output_dir / "checkpoints" / "step-000002" / "state.json").is_file()


def test_a_gateway_killed_at_the_final_checkpoint_is_restarted_and_the_run_reports(runs):
    """After the last step: the run still ends with its report, the fault in faults.json and in
    metrics.jsonl (a row of its own after the last step's)."""
    run = runs("servers")
    fault = run.fault(run.kill("gateway", at=("checkpoint_saved", 3)))
    assert fault["phase"] == ACK and "restarted on the same port" in fault["action"]
    out = run.result.output_dir
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4 and rows[-1]["faults/total"] == len(run.kills)


# ----------------------------------------------------------------------------------------------
# The environment runner and the trainer: replaced, their work redone
# ----------------------------------------------------------------------------------------------
def test_a_killed_environment_runner_is_replaced_and_its_groups_redone(runs):
    run = runs("sync")
    fault = run.fault(run.kill("runner"))
    assert "replaced" in fault["action"] and "generation redone" in fault["action"]
    # both sessions of task 2 were open at the gate: the gateway finished them as aborted
    assert re.search(r"aborted [2-9]", fault["action"]), fault["action"]


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_overlapping_modes_survive_a_killed_environment_runner(runs, mode):
    """Generation overlaps training (one-step-off: step k+1's while step k trains; async: a
    continuous stream): the runner dies with it in flight, the stream or the next step's groups
    are started again from the run's task position."""
    run = runs(mode)
    fault = run.fault(run.kill("runner"))
    assert "replaced" in fault["action"] and "generation redone" in fault["action"]
    assert all(lag <= 1 for r in run.result.trained for lag in r.lags)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_trainer_resumes_from_the_last_checkpoint_and_redoes_the_steps_after_it(runs, mode):
    """Checkpoints after steps 2 and 4; the trainer dies once step 4's batch is read, so step 3
    (trained, not checkpointed) is undone and redone: its first samples never count as trained."""
    run = runs(mode)
    fault = run.fault(run.kill("trainer"))
    assert "resumed from step-000002" in fault["action"]
    undone = [sid for sid, why in (run.result.not_trained or {}).items() if why == "trainer_restart"]
    assert len(undone) >= 4  # step 3's batch (2 tasks x 2 samples), and step 4's in the dead trainer's hands
    rows = [json.loads(line) for line in (run.result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 3, 4]  # step 3 logged twice
