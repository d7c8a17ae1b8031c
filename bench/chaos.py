"""A chaos soak: does a seeded async `palaestra train` on the long-horizon workload finish every step
with nothing lost and nothing trained twice while a schedule drawn from the seed SIGKILLs one of
its processes at a time?

    .venv/bin/python -m bench.chaos --faults 50 --steps 44 --seed 0
    .venv/bin/python -m bench.chaos --faults 12 --steps 10 env.tasks_per_step=2    # a short one

The run: configs/long_horizon.yaml in async mode on the tiny preset, shortened (`RUN`: 10 turns at
most, 4 tasks x 4 samples a step) and its tool calls made in local sandboxes
(bench/long_horizon_env.py's ``sandbox: local``), a checkpoint every 2 steps, each component allowed as many restarts as
there are faults. Trailing dotted overrides change any of it. The run joins a
`ray.cluster_utils.Cluster` on this machine (`ray_nodes`): the head holds the trainer, the router,
the gateway, the environment runner and engine-0; a worker node holds the other engine.

The schedule (`schedule`, from the seed alone): for each fault a kind, a moment, and the step
before which it does not fire, spread evenly over the run:

* kinds: ``engine`` (one of the engines, drawn), ``router``, ``gateway``, ``trainer`` (a rank,
  drawn), ``runner`` (the environment runner), ``sandbox`` (the sandbox of an episode in flight:
  its bwrap's process group, found among the runner's children; the episode fails, reason
  ``sandbox_error``, if it makes a call after the kill, and nothing restarts), ``node`` (the worker
  node under an engine, removed with `Cluster.remove_node`: the engine starts again on a node with
  room, or the run goes on without it; a node with room for one engine joins `NODE_BACK_S` later,
  and the engine left out rejoins at the next step's start);
* moments: ``generation`` (0.5-4 s after any phase of a step: episodes in flight), ``batch`` (the step's
  batch read, nothing of it trained), ``sync`` (0-1 s into the step's weight sync), ``checkpoint``
  (0-1 s into the trainer's save), ``checkpoint_saved`` (saved, the spool not told yet). A
  sandbox dies only during generation. A node is removed in the hook's thread (Ray's `Cluster`
  starts and stops nodes from the main thread only), at its moment's start.

Faults fire one at a time: the next waits until the driver has recovered from the last (its
`Fault` has a recovery time); a fault that cannot fire at its step (the last one still
recovering, no checkpoint in that step, no sandbox open) fires at the same moment of a later step;
none fires in the last step (a death after it ends the run: docs/reliability-faults.md).
Left out: the driver's death (tests/orchestrator/test_driver_kill.py).

Printed: faults injected per kind and moment, recovery per kind (median, max: from the driver
noticing the death to the run going on, `Fault.recovery_s`), steps completed, samples generated /
trained / not trained per reason, failed episodes per reason twice, from the metrics rows
(`rollout/failed_*`: only the groups a step's batch took) and from the spool (every failed episode,
by what became of its samples: `failed_episodes`), the sandbox kills split into those that failed an
episode and those that failed none, the node kills split by what became of their engine, and the
books (`orchestrator/audit.py`): lost and trained twice must be 0, every drop named. Not a CI test.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import common

KINDS = ("engine", "router", "gateway", "trainer", "runner", "sandbox", "node")
MOMENTS = ("generation", "batch", "sync", "checkpoint", "checkpoint_saved")
SERVERS = ("engine", "router", "gateway")
DELAY_S = {"generation": (0.5, 4.0), "sync": (0.0, 0.12), "checkpoint": (0.0, 0.25)}
"""Moments that fire from a timer: seconds after the hook's phase, drawn (the others fire in it);
a weight sync of the tiny preset takes ~0.15-0.6 s here, a trainer's save well under 1 s (a
12-step soak with 0-0.3 s and 0-0.8 s landed 2 of 6 kills inside them)."""
HOOK = {"batch": "batch", "sync": "sync", "checkpoint": "checkpoint", "checkpoint_saved": "checkpoint_saved"}
"""The run's hook phase (`loop.PHASES`) each moment starts from; generation starts from any (async
mode generates all the time)."""
COMPONENT = {"router": "router", "gateway": "gateway", "trainer": "trainer", "runner": "environment runner"}
RUN = (
    "run.mode=async",
    "run.checkpoint_every=2",
    "env.tasks_per_step=4",
    "env.samples_per_task=4",
    "env.concurrency=16",
    "env.args={max_turns: 10, min_tokens: 10, max_tokens: 30, tool_min_s: 0.05, tool_max_s: 1.0, "
    "sandbox: local}",
)
WAIT_S = 300.0
NODE_BACK_S = 20.0
"""Seconds after a node's removal that a node with room for one engine joins the cluster: the
engine left out meanwhile starts there at the next step's start (`Supervisor.rejoin_engines`), and a
later node fault has a node to kill."""
HEAD, SLOT = "palaestra_chaos_head", "palaestra_chaos_engine"
"""The Ray cluster's custom resources: the head (trainer, router, gateway, environment runner,
one engine) holds HEAD; one engine fits a node per SLOT (the head has one, each worker node one)."""


@dataclass
class Planned:
    """One fault of the schedule, and what became of it."""

    kind: str
    moment: str
    step: int  # 0-based; it fires at this step's `moment`, or a later step's
    delay_s: float  # after the moment's hook phase (timer moments), else 0
    pick: float  # which engine / rank / sandbox, in [0, 1)
    fired_step: int | None = None
    pid: int = 0
    component: str = ""
    killed_at: float = math.nan
    nth: int = 0  # faults of the component before this one
    note: str = ""
    phase_at: float = math.nan  # time.time() of the hook phase it fired from
    node: str = ""  # a node kill: the Ray node id removed


def schedule(seed: int, faults: int, steps: int, kinds: tuple[str, ...] = KINDS) -> list[Planned]:
    """`faults` faults over `steps` steps, drawn from `seed` alone: kinds in turn from a shuffled
    cycle (each kind about as often), a moment each (a sandbox's is generation), steps spread
    evenly from the second."""
    rng = random.Random(f"bench.chaos/{seed}")
    plan = []
    cycle: list[str] = []
    for i in range(faults):
        if not cycle:
            cycle = list(kinds)
            rng.shuffle(cycle)
        kind = cycle.pop()
        moment = "generation" if kind == "sandbox" else rng.choice(MOMENTS)
        lo, hi = DELAY_S.get(moment, (0.0, 0.0))
        step = 1 + (i * max(steps - 2, 1)) // max(faults, 1)  # from the second step to the last but one
        plan.append(Planned(kind, moment, min(step, steps - 2), round(rng.uniform(lo, hi), 3), rng.random()))
    return plan


def _dead(kill: Planned) -> tuple[str, ...]:
    """The components the run may report `kill`'s death as: a node's is ``node of engine-N``, or
    ``host of engine-N`` when the driver saw the engine's worker die before Ray marked the node dead."""
    if kill.kind == "node":
        engine = kill.component.removeprefix("node of ")
        return (f"node of {engine}", f"host of {engine}")
    return (kill.component,)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _sandboxes(runner_pid: int) -> list[int]:
    """The local sandboxes the runner holds: its children that lead their own process group (each
    sandbox's bwrap is started in a new session), by parentage, never by name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, pgrp = int(fields[1]), int(fields[2])
        if ppid == runner_pid and pgrp == int(entry.name):
            found.append(pgrp)
    return sorted(found)


class Chaos:
    """Carries out a schedule through the run's hook (`train(cfg, hook=chaos.hook)`)."""

    def __init__(self, plan: list[Planned], steps: int, nodes=None):
        self.plan, self.last_step = plan, steps - 1
        self.nodes = nodes  # the `ray.cluster_utils.Cluster` the run joined (node kills), or None
        self.joined: list[float] = []  # time.time() of each node added back after a node kill
        self.joins_due: list[float] = []  # time.time() after which a node joins (`_join_nodes`)
        self.queue = list(plan)
        self.lock = threading.Lock()
        self.busy: Planned | None = None  # fired, its recovery not seen yet
        self.run = None
        self.timers: list[threading.Thread] = []
        self.errors: list[str] = []
        self.seen: list[tuple[str, int, float]] = []  # (phase, step, time.time()) of every hook call

    # -- in the driver's thread ----------------------------------------------------------------
    def hook(self, phase: str, step: int, run) -> None:
        self.run = run
        self.seen.append((phase, step, time.time()))
        self._join_nodes()
        with self.lock:
            self._settle()
            if self.busy is not None or not self.queue:
                return
            if step >= self.last_step:  # a death after the last step ends a run (docs/reliability-faults.md)
                return
            due = [k for k in self.queue if HOOK.get(k.moment, phase) == phase and k.step <= step]
            if not due:
                return
            head = due[0]  # the earliest planned of those due at this phase
            self.queue.remove(head)
            head.fired_step, head.phase_at = step, time.time()
            self.busy = head
        if head.moment in DELAY_S and head.kind != "node":  # from a timer: the run goes on meanwhile
            timer = threading.Thread(target=self._fire_later, args=(head,), daemon=True)
            self.timers.append(timer)
            timer.start()
        else:  # in the hook: the process is gone before the driver goes on
            self._fire(head)

    def _settle(self) -> None:
        """Clears `busy` once the driver has recovered from it (a fault with a recovery time)."""
        kill = self.busy
        if kill is None or kill.component == "":
            return
        if kill.kind == "sandbox":
            self.busy = None
            return
        faults = [f for f in self.run.supervisor.faults if f.component in _dead(kill)]
        if len(faults) > kill.nth and math.isfinite(faults[kill.nth].recovery_s):
            self.busy = None

    # -- the kill ------------------------------------------------------------------------------
    def _fire_later(self, kill: Planned) -> None:
        time.sleep(kill.delay_s)
        self._fire(kill)

    def _fire(self, kill: Planned) -> None:
        try:
            kill.pid, kill.component = self._target(kill)
        except Exception as exc:  # noqa: BLE001 (the kill is put back for a later step)
            kill.pid, kill.component, kill.note = 0, "", f"{type(exc).__name__}: {exc}"
        if not kill.pid:
            with self.lock:  # nothing to kill now (no sandbox open, ...): a later step
                kill.fired_step, kill.note = None, ""
                self.queue.insert(0, kill)
                self.busy = None
            return
        kill.nth = sum(f.component in _dead(kill) for f in self.run.supervisor.faults)
        if kill.kind == "sandbox":
            os.killpg(kill.pid, signal.SIGKILL)
        elif kill.kind == "node":  # the raylet and every worker on it, the engine's with them
            self.nodes.remove_node(next(n for n in self.nodes.worker_nodes if n.node_id == kill.node))
            self.joins_due.append(time.time() + NODE_BACK_S)
        else:
            os.kill(kill.pid, signal.SIGKILL)
        kill.killed_at = time.time()
        deadline = time.monotonic() + WAIT_S
        while not _gone(kill.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _join_nodes(self) -> None:
        """A node with room for one engine joins `NODE_BACK_S` after each node's removal, at the
        first hook call after that (Ray's `Cluster` starts nodes from the main thread only)."""
        while self.joins_due and self.joins_due[0] <= time.time():
            self.joins_due.pop(0)
            self.nodes.add_node(**WORKER_NODE)
            self.joined.append(time.time())

    def _target(self, kill: Planned) -> tuple[int, str]:
        """(the pid to kill, the component the run will report it as) for `kill`, now."""
        import ray

        cluster = self.run.cluster
        if kill.kind == "node":  # a worker node under an engine (the head holds the rest); none: later
            workers = {n.node_id for n in self.nodes.worker_nodes}
            boxes = [b for b in cluster.engines if b.node in workers]
            if not boxes:
                return 0, ""
            box = boxes[int(kill.pick * len(boxes))]
            kill.node = box.node
            return ray.get(box.actor.pid.remote(), timeout=60), f"node of {box.name}"
        if kill.kind == "engine":
            box = cluster.engines[int(kill.pick * len(cluster.engines))]
            return ray.get(box.actor.pid.remote(), timeout=60), box.name
        if kill.kind in ("router", "gateway"):
            box = cluster.router if kill.kind == "router" else cluster.gateway
            return ray.get(box.actor.pid.remote(), timeout=60), COMPONENT[kill.kind]
        if kill.kind == "trainer":
            rank = cluster.trainer[int(kill.pick * len(cluster.trainer))]
            return ray.get(rank.ready.remote(), timeout=60)["pid"], COMPONENT["trainer"]
        runner = ray.get(cluster.rollout.info.remote(), timeout=60)["pid"]
        if kill.kind == "runner":
            return runner, COMPONENT["runner"]
        for _ in range(50):  # a sandbox of an episode in flight: wait a little for one
            boxes = _sandboxes(runner)
            if boxes:
                return boxes[int(kill.pick * len(boxes))], "sandbox"
            time.sleep(0.2)
        return 0, ""

    def finish(self) -> None:
        for timer in self.timers:
            timer.join(timeout=WAIT_S)

    def fired(self) -> list[Planned]:
        return [k for k in self.plan if k.pid]

    def landed_inside(self, kill: Planned, rows: list[dict]) -> bool | None:
        """Whether a sync or checkpoint kill landed before that phase ended: the sync's own
        seconds (`perf/sync_s` of its step's row), the save's end (the next ``checkpoint_saved``
        of that step; none: the save never finished). None for the other moments."""
        if kill.moment == "sync":
            row = [r for r in rows if r.get("step") == kill.fired_step + 1 and "perf/sync_s" in r]
            return bool(row) and kill.killed_at - kill.phase_at <= row[-1]["perf/sync_s"]
        if kill.moment == "checkpoint":
            ends = [
                t
                for p, s, t in self.seen
                if p == "checkpoint_saved" and s == kill.fired_step and t > kill.phase_at
            ]
            return not ends or kill.killed_at < ends[0]
        return None


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------
def failed_episodes(samples: list[dict], not_trained: dict[str, str]) -> dict[str, Counter[str]]:
    """Failed episodes in the spool (`samples`, as spooled), per failure reason (``failure/<reason>``
    of the session's metrics; ``error`` for an exception of no named reason), each counted once and
    split by the reason its samples have in the run's record (`not_trained`): ``failed`` (the feed
    read them as failed), or the fault that abandoned their group first (``runner_died``,
    ``trainer_restart``, ...). Only the groups a step's batch took are in a metrics row's
    ``rollout/failed_<reason>``."""
    out: dict[str, Counter[str]] = {}
    seen = set()
    for sample in samples:
        if sample.get("status") != "failed" or sample["session_id"] in seen:
            continue
        seen.add(sample["session_id"])
        metrics = sample.get("metrics") or {}
        named = sorted(
            k.removeprefix("failure/") for k, v in metrics.items() if k.startswith("failure/") and v
        )
        for reason in named or ["error"]:
            out.setdefault(reason, Counter())[not_trained.get(sample["sample_id"], "trained?")] += 1
    return out


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "—"


def report(chaos: Chaos, result, wall_s: float, steps: int, failed: str | None) -> str:
    from palaestra.orchestrator.audit import audit_run, report_problems

    fired = chaos.fired()
    faults = [f.to_dict() for f in chaos.run.supervisor.faults] if chaos.run is not None else []
    lines = [f"chaos soak: {len(fired)} of {len(chaos.plan)} planned faults injected in {wall_s:.0f} s"]
    if failed:
        lines.append(f"THE RUN FAILED: {failed}")
    out = None if result is None else result.output_dir
    rows = [] if out is None else [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lines += [
        "",
        "| kind | injected | moments | inside the sync / save | recovery s (median / max) | noticed during |",
        "|---|---|---|---|---|---|",
    ]
    reported = {}  # each kill's fault as the run reported it
    for k in fired:
        mine = [f for f in faults if f["component"] in _dead(k)]
        if k.kind != "sandbox" and len(mine) > k.nth:
            reported[id(k)] = mine[k.nth]
    for kind in KINDS:
        kills = [k for k in fired if k.kind == kind]
        if not kills:
            continue
        moments = Counter(k.moment for k in kills)
        recovery, phases = [], Counter()
        for k in kills:
            if id(k) in reported:
                recovery.append(reported[id(k)]["recovery_s"])
                phases[reported[id(k)]["phase"]] += 1
        inside = [chaos.landed_inside(k, rows) for k in kills if k.moment in ("sync", "checkpoint")]
        lines.append(
            f"| {kind} | {len(kills)} | {', '.join(f'{m} {n}' for m, n in sorted(moments.items()))} | "
            f"{f'{sum(map(bool, inside))} of {len(inside)}' if inside else '—'} | "
            f"{_ms([r for r in recovery if math.isfinite(r)]) if kind != 'sandbox' else '— (episode fails)'} | "
            f"{', '.join(f'{p} {n}' for p, n in phases.most_common()) or '—'} |"
        )
    every = [f["recovery_s"] for f in faults if math.isfinite(f["recovery_s"])]
    inside = [chaos.landed_inside(k, rows) for k in fired if k.moment in ("sync", "checkpoint")]
    lines.append(f"| all | {len(fired)} | | {sum(map(bool, inside))} of {len(inside)} | {_ms(every)} | |")
    if result is None:
        return "\n".join(lines)
    from palaestra.orchestrator.audit import spooled

    audit = audit_run(result)
    episode_failures = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("rollout/failed_") and value:
                episode_failures[key.removeprefix("rollout/failed_")] += int(value)
    in_spool = failed_episodes(spooled(result.output_dir), result.not_trained or {})
    # a node's death as the run saw it: `node of engine-N`, or `host of` when its worker died first
    server_kills = [reported[id(k)]["component"] if id(k) in reported else k.component
                    for k in fired if k.kind != "sandbox"]  # fmt: skip
    problems = audit.problems() + report_problems(result, server_kills)
    history = [r.step for r in result.trained]
    sandbox_kills = sum(k.kind == "sandbox" for k in fired)
    by_sandbox = in_spool.get("sandbox_error", Counter())
    node_faults = [reported[id(k)] for k in fired if k.kind == "node" and id(k) in reported]
    rejoined = sum("a node with room had joined" in f["action"] for f in node_faults)
    left_out = sum("no live node has room" in f["action"] for f in node_faults)
    lines += [
        "",
        f"steps completed: {result.state.step} of {steps}; each once in the history: "
        f"{history == list(range(steps))}; engines at version {sorted(set(result.engine_versions_end))}",
        f"samples: {audit.line()}",
        "failed episodes per reason, metrics rows (rollout/failed_*: the groups a step's batch took): "
        + (", ".join(f"{r} {n}" for r, n in sorted(episode_failures.items())) or "none"),
        "failed episodes per reason, spool (every one, by what became of its samples): "
        + (
            "; ".join(
                f"{r} {sum(c.values())} ({', '.join(f'{w} {n}' for w, n in sorted(c.items()))})"
                for r, c in sorted(in_spool.items())
            )
            or "none"
        ),
        f"sandbox kills: {sandbox_kills}: {sum(by_sandbox.values())} failed an episode (sandbox_error in "
        f"the spool; {by_sandbox['failed']} of them recorded `failed`, the others under the fault "
        f"that abandoned their group), {sandbox_kills - sum(by_sandbox.values())} failed none (no call of its "
        "episode after the kill, or the episode ended otherwise)",
        f"node kills: {len(node_faults)}: the engine started again at once {len(node_faults) - left_out}, "
        f"left out {left_out} (no node with room), of those rejoined when a node joined {rejoined}",
        f"the books: {'balance (0 lost, 0 trained twice, every drop named)' if not problems else 'DO NOT BALANCE'}",
        *(f"  - {p}" for p in problems),
    ]
    return "\n".join(lines)


WORKER_NODE = {"num_cpus": 1, "resources": {SLOT: 1}, "node_ip_address": "127.0.0.1",
               "object_store_memory": 128 * 1024 * 1024}  # fmt: skip
"""A worker node: room for one engine's bundle (1 CPU, one SLOT) and nothing else."""


def ray_nodes():
    """A `ray.cluster_utils.Cluster` on this machine, every node on 127.0.0.1: the head (the trainer,
    the router, the gateway, the environment runner and one engine: its HEAD and one SLOT) and one
    worker node (the other engine), which a node kill removes. This process joins it (`run.ray_address`)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node addresses of 127.0.0.1 taken literally
    # the nodes' workers import bench.long_horizon_env (by import path) from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(common.ROOT), os.environ.get("PYTHONPATH")] if p
    )
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the variable was set
    head = {"num_cpus": 4, "resources": {HEAD: 1, SLOT: 1}, "include_dashboard": False,
            "node_ip_address": "127.0.0.1", "object_store_memory": 512 * 1024 * 1024}  # fmt: skip
    # a loaded machine's GCS or raylet may miss Ray's start-up deadline: again, that failure only
    nodes = common.retry_ray_start(lambda: Cluster(initialize_head=True, head_node_args=head), "the Ray head")
    nodes.add_node(**WORKER_NODE)
    nodes.wait_for_nodes()
    return nodes


@contextlib.contextmanager
def _shut(nodes):
    try:
        yield
    finally:
        nodes.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--faults", type=int, default=50, help="faults to inject (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    ap.add_argument(
        "--seed", type=int, default=0, help="the schedule's and the run's seed (default: %(default)s)"
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds (default: %(default)s)")
    ap.add_argument("--out", default=None, help="the run's directory (default: a temporary one, removed)")
    ap.add_argument("--print-schedule", action="store_true", help="print the schedule and exit")
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides, e.g. env.tasks_per_step=2")
    args = ap.parse_args(argv)
    kinds = tuple(common.csv(args.kinds))
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; the kinds are {', '.join(KINDS)}")
    if args.steps < 3:
        ap.error("--steps: at least 3 (faults start at the second step)")
    plan = schedule(args.seed, args.faults, args.steps, kinds)
    if args.print_schedule:
        for k in plan:
            print(f"step {k.step + 1:3d}  {k.kind:8s} {k.moment:16s} +{k.delay_s:.2f} s  pick {k.pick:.2f}")
        return 0
    os.chdir(common.ROOT)  # the environment loads by import path (bench.*) in the Ray workers
    os.environ["RAY_worker_niceness"] = "0"  # the workers keep this process's priority
    nodes = ray_nodes()
    chaos = Chaos(plan, args.steps, nodes)
    overrides = [
        *RUN,
        f"run.ray_address={nodes.address}",
        "run.placement=decoupled",
        f"run.resources={{trainer: {{{HEAD}: 0.01}}, engines: {{{SLOT}: 1}}, services: {{{HEAD}: 0.01}}}}",
        f"run.steps={args.steps}",
        f"run.seed={args.seed}",
        f"run.max_restarts={max(args.faults, 3)}",
        *args.overrides,
    ]
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp, _shut(nodes):
        out = Path(args.out) if args.out else Path(tmp) / "run"
        from palaestra.config import load_config
        from palaestra.orchestrator.errors import RunFailed
        from palaestra.train import train

        cfg = load_config(
            common.ROOT / "configs" / "long_horizon.yaml",
            [f"run.output_dir={out}", "run.name=bench-chaos", "logging.tensorboard_dir=null", *overrides],
        )
        started, result, failed = time.perf_counter(), None, None
        try:
            result = train(cfg, hook=chaos.hook)
        except RunFailed as exc:
            failed = str(exc)
        finally:
            chaos.finish()
        wall_s = time.perf_counter() - started
        out.mkdir(parents=True, exist_ok=True)
        (out / "chaos-faults.json").write_text(json.dumps([asdict(k) for k in plan], indent=1))
        print(report(chaos, result, wall_s, args.steps, failed))
    return 0 if failed is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
