"""Supervision of a run's boxes: every process death noticed, repaired, counted and reported.

    supervisor = Supervisor(cluster, max_restarts=cfg.run.max_restarts)
    waiter = Waiter(supervisor, cfg.run.step_timeout_s)    # every wait checks the boxes through it
    ...
    supervisor.faults                                       # what died, when, what was done, how long

What a death costs, per box (docs/reliability-faults.md has the measured recovery times):

* an engine, the router, the gateway (server subprocesses of `server_host.ServerHost`): restarted in
  place with the same command on the same port, so every URL the others hold stays valid (the
  gateway on the same spool directory, with the same keys; so is each shard of gateway.shards > 1
  and their front, which holds no state). A restarted engine loads the weights
  the others hold (`Cluster.bring_engine_up_to_date`) before the wait goes on. Episodes whose
  calls failed meanwhile retry or end failed, counted by their groups. A gateway that comes back
  without the sessions open at its death (no session journal) makes the run redo the generation
  in flight (`Replaced`, raised by the next wait that may be redone).
* an engine's host actor (the Ray worker running its `ServerHost`), or the node under it: the
  router drops its URL, and it starts again wherever Ray places its bundle anew (a live node with
  room) with the weights the others hold, or, with no room anywhere, the run goes on with the
  engines left and says so (`Cluster.replace_engine`; fault `node of engine-N` / `host of
  engine-N`), until a node with room joins: at a step's start the engine left out starts there
  and rejoins (`rejoin_engines`; its fault's action says so). The host actor of any other server
  failing fails the run (resume it).
* the environment runner (the `RolloutWorker` actor): replaced (`Cluster.replace_rollout`), the
  sessions it left open finished on the gateway as aborted; `Replaced` tells the run to redo the
  generation it had in flight (`loop.Run.recover`).
* a trainer rank: `Replaced`; the run rebuilds every rank and resumes from the last checkpoint.

Each death is a `Fault`; one more death of a component than `run.max_restarts` fails the run with
a `RunFailed` naming it, what was seen and its log tail.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from palaestra.orchestrator.errors import Replaced, RunFailed, root_cause

__all__ = [
    "GATEWAY",
    "RUNNER",
    "TRAINER",
    "Fault",
    "Supervisor",
    "earlier_faults",
    "fault_kind",
    "write_faults",
]

log = logging.getLogger(__name__)

RUNNER = "environment runner"
TRAINER = "trainer"
GATEWAY = "gateway"


@dataclass
class Fault:
    """One death and what the run did about it."""

    component: str  # "engine-1", "router", "gateway", RUNNER, TRAINER
    at: str  # UTC time the death was noticed
    phase: str  # what the run was waiting for then
    seen: str  # how it showed: the exit code, or Ray's error
    action: str = ""  # what was done
    recovery_s: float = math.nan  # from noticing it to the run going on
    launch: str = ""  # the launch of the run it happened in (`Cluster.run_id`; a resumed run has several)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        took = "not recovered" if math.isnan(self.recovery_s) else f"recovered in {self.recovery_s:.1f} s"
        return f"{self.at} {self.component} during {self.phase}: {self.seen}; {self.action} ({took})"


def fault_kind(component: str) -> str:
    """The `faults/<kind>` counter of a component: engine, gateway_shard, engine_node (an engine's
    node died), engine_host (its host actor alone), router, gateway, environment_runner, trainer."""
    for prefix, kind in (("engine-", "engine"), ("gateway-shard-", "gateway_shard"),
                         ("node of ", "engine_node"), ("host of ", "engine_host")):  # fmt: skip
        if component.startswith(prefix):
            return kind
    return component.replace(" ", "_")


def earlier_faults(path: Path) -> list[dict[str, Any]]:
    """The faults of a run's earlier launches, from the `faults.json` a resumed launch finds (none:
    []), each with its launch (one of a file written before faults named theirs: ``earlier``)."""
    try:
        saved = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    return [{**f, "launch": f.get("launch") or "earlier"} for f in saved]


def write_faults(path: Path, faults: list[dict[str, Any]]) -> None:
    """`faults.json`, replaced whole (a driver killed mid-write leaves the previous one)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(faults, indent=1) + "\n")
    os.replace(tmp, path)


class Supervisor:
    """The Waiter's liveness check (`check_alive`, `actor_died`), repairing what it finds."""

    def __init__(self, cluster: Any, max_restarts: int, launch: str = ""):
        self.cluster, self.max_restarts, self.launch = cluster, max_restarts, launch
        self.faults: list[Fault] = []
        self.restarts: Counter[str] = Counter()
        # A fault whose loss shows only in the generation (a gateway restarted without its open
        # sessions): raised by the next wait that may be redone (`take_pending`), never in the
        # middle of training or a weight sync.
        self.pending: Replaced | None = None
        self._counted = 0  # faults already in a metrics row

    def new_counters(self) -> dict[str, float]:
        """`faults/*` counters of the faults since the last call (for the step's metrics row)."""
        new, self._counted = self.faults[self._counted :], len(self.faults)
        if not new:
            return {}
        out = {"faults/total": float(len(self.faults))}
        for fault in new:
            kind = fault_kind(fault.component)
            out[f"faults/{kind}"] = out.get(f"faults/{kind}", 0.0) + 1.0
            out[f"faults/{kind}_recovery_s"] = fault.recovery_s
        return out

    def take_pending(self) -> Replaced | None:
        pending, self.pending = self.pending, None
        return pending

    def _noticed(
        self, component: str, phase: str, seen: str, *, label: str = "", tail: str = "", log_file: str = ""
    ) -> Fault:
        """Records the fault, or fails the run when the component has used up its restarts."""
        self.restarts[component] += 1
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fault = Fault(component, at, phase, seen, launch=self.launch)
        self.faults.append(fault)
        log.warning("%s %s during %s", component, seen, phase)
        if self.restarts[component] > self.max_restarts:
            fault.action = f"none: run.max_restarts={self.max_restarts} used up"
            where = f" Log: {log_file}" if log_file else ""
            block = f"\n--- last output of {component} ---\n{tail.rstrip()}" if tail else ""
            raise RunFailed(
                f"{label or component} {seen} during {phase}; it died {self.restarts[component]} "
                f"time(s), more than run.max_restarts={self.max_restarts}: the run stops.{where}{block}"
            )
        return fault

    def recovered(self, fault: Fault, action: str, started: float) -> None:
        fault.action, fault.recovery_s = action, time.monotonic() - started
        log.warning("%s: %s (%.1f s)", fault.component, action, fault.recovery_s)

    def last(self, component: str) -> Fault:
        return next(f for f in reversed(self.faults) if f.component == component)

    # -- the servers ---------------------------------------------------------------------------
    def check_alive(self, phase: str) -> bool:
        """Restarts every server whose process has exited; True if it restarted any. A server's
        host actor that died (not just its process) fails the run."""
        import ray

        boxes = self.cluster.servers
        refs = [b.actor.poll.remote() for b in boxes]
        repaired = False
        for box, ref in zip(boxes, refs, strict=True):
            try:
                code = ray.get(ref, timeout=30)
            except ray.exceptions.ActorDiedError as exc:
                if box not in self.cluster.engines:
                    raise RunFailed(
                        f"{phase}: the host actor of {box.name} died ({root_cause(exc)}); only an engine's "
                        "is replaced: run again with run.resume=true to continue from the last checkpoint"
                    ) from None
                self._replace_engine(box, phase, exc)
                repaired = True
                continue
            except ray.exceptions.RayActorError as exc:
                raise RunFailed(f"{phase}: a server's host actor died: {root_cause(exc)}") from None
            if code is not None:
                self._restart_server(box, code, phase)
                repaired = True
        return repaired

    def _replace_engine(self, box: Any, phase: str, exc: BaseException) -> None:
        """An engine's host actor died (its node with it, or alone): `Cluster.replace_engine` starts
        it again where Ray finds room, or the run goes on with the engines left. An actor that dies
        meanwhile (a trainer rank while told the engines) is `actor_died`'s, as elsewhere."""
        import ray

        started = time.monotonic()
        node_gone = bool(box.node) and not self.cluster.node_alive(box.node)
        component = f"{'node' if node_gone else 'host'} of {box.name}"
        where = f"node {box.node[:8]} died" if node_gone else "its Ray actor died"
        fault = self._noticed(
            component, phase, f"{where} ({root_cause(exc).strip()})", label=f"{box.name} ({box.url})"
        )
        try:
            action = self.cluster.replace_engine(box)
        except ray.exceptions.RayActorError as died:
            left = ", ".join(b.name for b in self.cluster.engines) or "none"
            fault.action = f"an actor died meanwhile ({root_cause(died)}); the engines live then: {left}"
            self.actor_died(died, phase)  # raises Replaced: a trainer rank is rebuilt with those engines
        except Exception as e:  # noqa: BLE001 (any failure to replace ends the run, explained)
            fault.action = f"replacement failed: {e}"
            raise RunFailed(
                f"{box.name} ({box.url}): {where} during {phase}, and replacing it failed: {e}"
            ) from None
        log.warning("%s during %s: %s", component, phase, action)  # the one line that says so
        self.recovered(fault, action, started)

    def rejoin_engines(self, phase: str) -> list[str]:
        """Starts every engine left out for want of room whose bundle Ray has placed on a node
        that joined since (`Cluster.rejoin_engines`); each one's fault gets the rejoin added to
        its action. The names of those that rejoined."""
        import ray

        if not self.cluster.left_out:
            return []
        if self.cluster.trainer:  # a rejoin tells the trainer: a rank dead meanwhile is rebuilt first
            try:
                ray.get([rank.ready.remote() for rank in self.cluster.trainer], timeout=120)
            except ray.exceptions.RayActorError as exc:
                self.actor_died(exc, phase)  # raises Replaced

        started = time.monotonic()
        names = []
        try:
            rejoined = self.cluster.rejoin_engines()
        except ray.exceptions.RayActorError as exc:  # a rank died while being told the engines
            self.actor_died(exc, phase)  # raises Replaced: the trainer is rebuilt with them
        for name, action in rejoined:
            took = time.monotonic() - started
            log.warning("%s, left out, rejoined during %s: %s (%.1f s)", name, phase, action, took)
            dead = (f"node of {name}", f"host of {name}")
            fault = next((f for f in reversed(self.faults) if f.component in dead), None)
            if fault is not None:
                fault.action += f"; at {phase} a node with room had joined: {action} ({took:.1f} s)"
            names.append(name)
        return names

    def _restart_server(self, box: Any, code: int, phase: str) -> None:
        import ray

        started = time.monotonic()
        tail = ray.get(box.actor.log_tail.remote(1500), timeout=30)
        fault = self._noticed(
            box.name,
            phase,
            f"exited with code {code}",
            label=f"{box.name} ({box.url})",
            tail=tail,
            log_file=box.log or "",
        )
        try:
            extra = self.cluster.restart_args(box)
            ray.get(box.actor.restart.remote(extra), timeout=600)
            action = f"restarted on the same port ({box.url})" + (f" with {' '.join(extra)}" if extra else "")
            if box in self.cluster.engines:
                action += "; " + self.cluster.bring_engine_up_to_date(box)
            if box is self.cluster.router and self.cluster.router_urls != [
                b.url for b in self.cluster.engines
            ]:
                self.cluster.sync_router()  # it came back with the workers it started with
                action += f"; its workers set to the engines left ({len(self.cluster.engines)})"
            if box in self.cluster.gateway_shards:  # a shard is a gateway: its own journal and spool
                lost = self.cluster.sessions_lost()
                if lost:  # without a session journal the restarted gateway knows none of them
                    action += f"; {lost} open sessions lost with it: their groups are generated again"
                    self.pending = Replaced(GATEWAY, f"{lost} open sessions lost", started)
        except Exception as exc:  # noqa: BLE001 (any failure to restart ends the run, explained)
            fault.action = f"restart failed: {exc}"
            raise RunFailed(
                f"{box.name} ({box.url}) exited with code {code} during {phase} and could not be "
                f"restarted: {root_cause(exc) if isinstance(exc, ray.exceptions.RayError) else exc}. "
                f"Log: {box.log}"
            ) from None
        self.recovered(fault, action, started)

    # -- the actors ----------------------------------------------------------------------------
    def actor_died(self, exc: BaseException, phase: str) -> NoReturn:
        """A Ray call failed because its actor died: the environment runner is replaced here, a
        trainer rank is left to the run (it needs the checkpoint); both raise `Replaced`."""
        import ray

        started = time.monotonic()
        dead = getattr(exc, "actor_id", None)
        cluster = self.cluster
        trainer_ids = {w._actor_id.hex() for w in cluster.trainer}
        runner = cluster.rollout is not None and dead == cluster.rollout._actor_id.hex()
        if dead is None and cluster.rollout is not None:  # no id in the error: ask the runner
            try:
                ray.get(cluster.rollout.info.remote(), timeout=10)
            except ray.exceptions.RayError:
                runner = True
        seen = f"died ({root_cause(exc)})"
        if runner:
            fault = self._noticed(RUNNER, phase, seen)
            outcome = cluster.replace_rollout()
            fault.action = "replaced; its open sessions finished on the gateway: " + (
                ", ".join(f"{k} {v}" for k, v in sorted(outcome.items())) or "none open"
            )
            raise Replaced(RUNNER, seen, started)
        if dead is None or dead in trainer_ids:
            self._noticed(TRAINER, phase, seen)
            raise Replaced(TRAINER, seen, started)
        raise RunFailed(f"{phase}: an actor died: {seen}")
