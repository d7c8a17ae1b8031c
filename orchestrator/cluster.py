"""The Ray cluster of a run: Ray itself, the boxes as actors, their liveness, and their end.

    with start_cluster(cfg, weight_version=0, output_dir=cfg.output_dir) as cluster:
        cluster.engines, cluster.router, cluster.gateway   # Boxes: actor, URL, log file
        cluster.trainer_call("save", path)                  # refs of a method on every trainer rank

* `init_ray` — a local Ray bound to loopback (or the cluster in ``RAY_ADDRESS``).
* `Cluster` — starts the engines, the router, the gateway, the rollout worker and the trainer
  ranks as Ray actors (`server_host.py`, `rollout_worker.py`, `trainer_worker.py`) in a placement group (`placement.py`), hands out their URLs,
  checks that they are alive, replaces what died (`replace_rollout`, `replace_trainer`, and
  `replace_engine` for an engine whose node died), and stops them all. Nothing here assumes one
  machine: every URL comes from the actor that runs the server.
* `start_cluster` — the models the run names (built once, with progress), Ray, the cluster; on
  leaving, everything it started is stopped.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from palaestra.config import RunConfig, to_flags
from palaestra.gateway.shards import shard_spool
from palaestra.orchestrator.errors import RunFailed, root_cause
from palaestra.orchestrator.ledger import open_sessions
from palaestra.orchestrator.placement import (
    RayPlacement,
    engine_threads_beside_trainer,
    engines_beside_trainer,
    logical_cpus_needed,
    place,
    trainer_world_size,
)
from palaestra.orchestrator.rollout_worker import RolloutWorker
from palaestra.orchestrator.server_host import ServerHost
from palaestra.orchestrator.trainer_worker import TrainerWorker, torch_threads

__all__ = ["Box", "Cluster", "build_models", "init_ray", "start_cluster"]

log = logging.getLogger(__name__)

PLACE_WAIT_S = 60.0
"""How long `Cluster.replace_engine` waits for Ray to place a dead engine's bundle on a live node
that has room, before the run goes on without it."""


def _engine_number(name: str) -> int:
    """N of ``engine-N``."""
    return int(name.rsplit("-", 1)[1])


# ----------------------------------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------------------------------
def init_ray(host: str = "127.0.0.1", num_cpus: int | None = None, address: str | None = None) -> bool:
    """Joins the Ray cluster at `address` (`run.ray_address`; else ``RAY_ADDRESS`` if set), or
    starts a local Ray; returns True if this call connected or started it.

    On loopback every Ray process binds 127.0.0.1: Ray resolves a `_node_ip_address` of 127.0.0.1
    to the machine's outward IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` ("single-node Ray",
    which Linux allows too), so that is set before Ray is imported. Also off: the dashboard, usage
    stats. Ray's GCS, raylet, object manager and workers then listen on 127.0.0.1 only. Ray's token
    authentication stays on, chosen explicitly (RAY_AUTH_MODE=token) so that it starts silently.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if host in ("127.0.0.1", "localhost") and not address:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address and "ray" not in sys.modules:
        # A new local Ray turns token authentication on by itself and warns so at every start
        # ("... Set RAY_AUTH_MODE=disabled to opt out"). Choosing it explicitly with the variable
        # Ray documents keeps it on and says nothing; a RAY_AUTH_MODE of the user's own wins. Only
        # before Ray is imported: it reads the mode then, and a late change leaves this process
        # without the token its own cluster asks for. A cluster being joined keeps its own mode.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info("joined Ray at %s: %d node(s), %s", address, len(nodes), ray.cluster_resources())
        return True
    from ray._private import ray_constants

    if host in ("127.0.0.1", "localhost") and ray_constants.ENABLE_RAY_CLUSTER:
        # Ray was imported before the variable was set (e.g. by a test): same switch, read late.
        ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address=host if host not in ("0.0.0.0", "::") else None,
        num_cpus=num_cpus or os.cpu_count(),
        object_store_memory=512 * 1024 * 1024,
        logging_level=logging.WARNING,
        log_to_driver=True,
    )
    return True


# ----------------------------------------------------------------------------------------------
# The cluster of boxes
# ----------------------------------------------------------------------------------------------
@dataclass
class Box:
    """A running actor and what the driver knows about it."""

    name: str
    actor: Any
    url: str | None = None
    log: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the actor's Ray options (an engine's bundle)
    node: str = ""  # the Ray node id it runs on (engines: `Cluster.replace_engine` asks if it is alive)


@dataclass
class Cluster:
    cfg: RunConfig
    engines: list[Box] = field(default_factory=list)
    router: Box | None = None
    gateway: Box | None = None  # what clients call: the gateway, or with gateway.shards > 1 the front
    gateway_shards: list[Box] = field(default_factory=list)  # the gateway processes (one: `gateway`)
    rollout: Any = None
    trainer: list[Any] = field(default_factory=list)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))  # tells this launch's samples apart
    placement: RayPlacement | None = None
    placement_lines: list[str] = field(default_factory=list)  # where each box runs, printed at start
    startup_s: dict[str, float] = field(default_factory=dict)
    log_dir: str = ""
    # The engines' weights as (version, safetensors directory): None = their start-up weights (no
    # sync yet), else where the trainer's last sync left them (`TrainerWorker.synced_weights_dir`;
    # None there: none on disk). A restarted engine loads them (`bring_engine_up_to_date`).
    engine_weights: tuple[str, str | None] | None = None
    rollout_attempt: int = 0  # environment runners replaced so far (each has its own ledger)
    # Between `pause_gateway` and `resume_gateway` (a weight sync in async mode): a gateway that
    # dies meanwhile is restarted paused (`restart_args`), so nothing generates mid-update.
    gateway_paused: bool = False
    # How the engines were started (backend, model, flags, host, weight version): an engine whose
    # node died starts again this way on another node (`replace_engine`).
    engine_start: tuple[str, str, list[str], str, str] | None = None
    router_urls: list[str | None] = field(default_factory=list)  # the workers the router starts with
    # Engines whose node died when no live node had room for them: each starts again once Ray places
    # its bundle on a node that joined later (`rejoin_engines`, at a step's start).
    left_out: list[Box] = field(default_factory=list)
    trainer_pids: list[int] = field(default_factory=list)  # of the trainer ranks (`remove_trainer_files`)

    @property
    def servers(self) -> list[Box]:
        return [
            *self.engines,
            *([self.router] if self.router else []),
            *self.gateway_shards,
            *([self.gateway] if self.gateway and self.gateway not in self.gateway_shards else []),
        ]

    def start(self, *, weight_version: int, spool_dir: str, log_dir: str) -> Cluster:
        """Engines (while the trainer ranks import Megatron) → router, gateway, environment (while
        the trainer builds its model) → done. Engines start at `weight_version`."""
        import ray

        cfg = self.cfg
        self.log_dir = log_dir
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.placement = place(cfg, gpus)
        t0 = time.perf_counter()
        try:
            ray.get(self.placement.group.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(
                f"Ray could not place the trainer and engines ({cfg.run.placement}: bundles "
                f"{self.placement.group.bundle_specs}) within 120 s; the cluster has "
                f"{ray.cluster_resources()}"
            ) from None
        server = ray.remote(ServerHost)
        flags = cfg.engines.serve_flags() if cfg.engines.backend == "embedded" else cfg.engines.sglang_flags()
        flags += lora_engine_flags(cfg) + routing_engine_flags(cfg)
        for i, opts in enumerate(self.placement.engines):
            name = f"engine-{i}"
            self.engines.append(
                Box(
                    name,
                    server.options(**opts).remote(name, log_dir),
                    log=f"{log_dir}/{name}.log",
                    options=opts,
                )
            )
        self.trainer = self._start_trainer()  # imports megatron-core while the engines load
        self.engine_start = (cfg.engines.backend, cfg.model.student, flags, cfg.run.host, str(weight_version))
        engine_refs = [b.actor.start_engine.remote(*self.engine_start, 1800.0) for b in self.engines]
        for box, url in zip(self.engines, self._get_all(engine_refs, "starting the engines"), strict=True):
            box.url = url
        nodes = self._get_all([b.actor.node_id.remote() for b in self.engines], "locating the engines")
        for box, node in zip(self.engines, nodes, strict=True):
            box.node = node
        self.startup_s["engines"] = time.perf_counter() - t0
        urls = [b.url for b in self.engines]
        master = self._get_all([self.trainer[0].rendezvous_address.remote()], "trainer rendezvous")[0]
        building = self.trainer_call("build", trainer_options(cfg), cfg.model.student, urls, master)
        services = cfg.run.resources.get("services", {})
        light = server.options(num_cpus=0, resources=services)
        self.router_urls = [b.url for b in self.engines]
        self.router = Box("router", light.remote("router", log_dir), log=f"{log_dir}/router.log")
        self.router.url = self._get_all(
            [
                self.router.actor.start_router.remote(
                    [b.url for b in self.engines], cfg.router_flags(), cfg.run.host
                )
            ],
            "starting the router",
        )[0]
        self._start_gateways(light, spool_dir, log_dir)
        self.startup_s["servers"] = time.perf_counter() - t0
        self.rollout = self._start_rollout()
        rollout_info = self._get_all([self.rollout.info.remote()], "starting the environment")[0]
        ranks = self._get_all(building, "building the trainer")
        self.trainer_pids = [r["pid"] for r in ranks]
        self.startup_s["all"] = time.perf_counter() - t0
        self.placement_lines = self._describe(ranks, rollout_info, master)
        for line in self.placement_lines:
            log.info("%s", line)
        return self

    def _start_gateways(self, light: Any, spool_dir: str, log_dir: str) -> None:
        """The gateway, or with gateway.shards=N its N shards (each spooling to its own
        `spool/shard-<i>`) started together, then their front (`palaestra gateway front`), which is
        `self.gateway` then: every client's URL (gateway/shards.py)."""
        cfg, n = self.cfg, self.cfg.gateway.shards
        keys = {"PALAESTRA_API_KEY": self.api_key, "PALAESTRA_ADMIN_KEY": self.admin_key}
        flags = [*lora_gateway_flags(cfg), *routing_gateway_flags(cfg)]
        names = ["gateway"] if n == 1 else [f"gateway-shard-{i}" for i in range(n)]
        self.gateway_shards = [
            Box(name, light.remote(name, log_dir), log=f"{log_dir}/{name}.log") for name in names
        ]
        refs = [
            box.actor.start_gateway.remote(
                cfg.model.student,
                self.router.url,
                shard_spool(spool_dir, i, n),
                [*cfg.gateway.for_shard(i, n).serve_flags(), *flags],
                cfg.run.host,
                keys,
            )
            for i, box in enumerate(self.gateway_shards)
        ]
        for box, url in zip(self.gateway_shards, self._get_all(refs, "starting the gateway"), strict=True):
            box.url = url
        if n == 1:
            self.gateway = self.gateway_shards[0]
            return
        self.gateway = Box("gateway", light.remote("gateway", log_dir), log=f"{log_dir}/gateway.log")
        self.gateway.url = self._get_all(
            [
                self.gateway.actor.start_front.remote(
                    [b.url for b in self.gateway_shards], cfg.run.host, cfg.gateway.event_loop
                )
            ],
            "starting the gateway front",
        )[0]

    def _start_rollout(self) -> Any:
        """The environment runner actor, with its own session ledger (`ledger.py`)."""
        import ray

        cfg = self.cfg
        rollout = ray.remote(RolloutWorker).options(
            num_cpus=0, max_concurrency=1000, resources=cfg.run.resources.get("services", {})
        )
        return rollout.remote(
            cfg.env.name,
            # env.args.temperature may only repeat trainer.temperature (checkpoint.prepare_run): the
            # run's sampling settings reach the environment in `session.sampling`, not its arguments.
            {k: v for k, v in cfg.env.args.items() if k != "temperature"},
            {"temperature": cfg.trainer.temperature},
            self.gateway.url,
            self.api_key,
            cfg.run.seed,
            cfg.env.samples_per_task,
            cfg.env.concurrency,
            self.run_id,
            self._ledger(),
        )

    def _ledger(self) -> str:
        return f"{self.log_dir}/rollout-sessions-{self.rollout_attempt}.jsonl"

    def _describe(self, ranks: list[dict], rollout_info: dict, master: tuple[str, int]) -> list[str]:
        """Where every box runs (printed at start): node address and id, URL, resources asked."""
        import ray

        cfg, world = self.cfg, trainer_world_size(self.cfg)
        tp = world // cfg.trainer.dp_size
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        lines = [
            f"placement ({cfg.run.placement}, {nodes} Ray node(s), bundles {self.placement.group.bundle_specs}):"
        ]
        for r in ranks:
            lines.append(
                f"  trainer rank {r['rank']} (dp {r['rank'] // tp}, tp {r['rank'] % tp}): {r['node']}"
            )
        if world > 1:
            lines.append(f"  trainer rendezvous (torch.distributed): {master[0]}:{master[1]}")
        for box in self.servers:
            lines.append(f"  {box.name}: {ray.get(box.actor.where.remote(), timeout=30)} at {box.url}")
        lines.append(f"  environment runner: {rollout_info['node']}")
        return lines

    def _engines_beside_trainer(self) -> int:
        """Engines whose bundle Ray placed on a trainer rank's node (the group is ready: `start`)."""
        from ray.util.placement_group import placement_group_table

        assert self.placement is not None
        table = placement_group_table(self.placement.group)["bundles_to_node_id"]
        return engines_beside_trainer(self.placement, table)

    def _start_trainer(self) -> list[Any]:
        """The trainer rank actors (rank 0 hosts the rendezvous, asked for in `start`)."""
        import ray

        world = trainer_world_size(self.cfg)
        worker = ray.remote(TrainerWorker)
        reserve = engine_threads_beside_trainer(self.cfg, self._engines_beside_trainer())
        omp = os.environ.get("OMP_NUM_THREADS")  # the driver's: respected by every rank
        torch_threads(reserve, world, omp)  # a bad value fails here, in one line, before any actor starts
        assert self.placement is not None
        return [
            worker.options(**opts).remote(rank, world, reserve, omp)
            for rank, opts in enumerate(self.placement.trainer)
        ]

    def _get_all(self, refs: list, phase: str) -> list:
        """`ray.get` that turns an actor's failure into a RunFailed naming the phase."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RunFailed(f"{phase} failed: {root_cause(exc)}") from None

    # -- liveness ------------------------------------------------------------------------------
    def check_alive(self, phase: str) -> None:
        """Raises RunFailed naming the first server whose process has exited (or whose actor died)."""
        import ray

        boxes = self.servers
        refs = [b.actor.poll.remote() for b in boxes]
        try:
            codes = ray.get(refs, timeout=30)
        except ray.exceptions.RayActorError as exc:
            raise RunFailed(f"{phase}: a server's actor died: {root_cause(exc)}") from None
        for box, code in zip(boxes, codes, strict=True):
            if code is not None:
                tail = ray.get(box.actor.log_tail.remote(1500), timeout=30)
                raise RunFailed(
                    f"{box.name} ({box.url}) exited with code {code} during {phase}; the run stops. "
                    f"Log: {box.log}\n--- last output of {box.name} ---\n{tail.rstrip()}"
                )

    # -- replacing what died (`supervisor.Supervisor`) ------------------------------------------
    def replace_rollout(self) -> Counter[str]:
        """A new environment runner for the dead one; the sessions the dead one left open (its
        ledger) are finished on the gateway as aborted. Returns the outcome per session."""
        import ray

        ray.kill(self.rollout)
        outcome: Counter[str] = Counter()
        opened = open_sessions(self._ledger())
        with httpx.Client(timeout=30, trust_env=False) as client:
            for sid in opened:
                try:
                    r = client.post(
                        f"{self.gateway.url}/sessions/{sid}/reward",
                        json={"reward": 0.0, "status": "aborted", "metrics": {"runner_died": 1.0}},
                        headers={"Authorization": f"Bearer {self.api_key}"},
                    )
                    outcome["aborted" if r.is_success else f"HTTP {r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    outcome[type(exc).__name__] += 1
        self.rollout_attempt += 1
        self.rollout = self._start_rollout()
        self._get_all([self.rollout.info.remote()], "replacing the environment runner")
        return outcome

    def sessions_lost(self) -> int:
        """How many sessions the environment runner holds open (its ledger) that the gateway does
        not know: those a restarted gateway lost."""
        lost = 0
        with httpx.Client(timeout=30, trust_env=False) as client:
            for sid in open_sessions(self._ledger()):
                r = client.get(
                    f"{self.gateway.url}/sessions/{sid}", headers={"Authorization": f"Bearer {self.api_key}"}
                )
                lost += r.status_code == 404
        return lost

    def replace_trainer(self) -> None:
        """Every trainer rank anew (one rank's death leaves the others in a broken process group),
        built on the model's base weights; the run then loads its checkpoint into them."""
        import ray

        for worker in self.trainer:
            ray.kill(worker)
        dead, self.trainer = self.trainer_pids, self._start_trainer()
        master = self._get_all([self.trainer[0].rendezvous_address.remote()], "trainer rendezvous")[0]
        urls = [b.url for b in self.engines]
        ranks = self._get_all(
            self.trainer_call("build", trainer_options(self.cfg), self.cfg.model.student, urls, master),
            "rebuilding the trainer",
        )
        self.trainer_pids = [r["pid"] for r in ranks]
        self.remove_trainer_files(dead)  # the old ranks are gone by now (ray.kill, or the death itself)

    def remove_trainer_files(self, pids: list[int]) -> list[Path]:
        """The weight-sync folders in shared memory (/dev/shm, or `trainer.sync.dir`) that dead
        trainer ranks `pids` left on this host (`shm_sync.remove_dead_writer`): a killed rank runs
        no finalizer. The folders removed."""
        from palaestra.trainer.shm_sync import remove_dead_writer

        roots = [None, *([self.cfg.trainer.sync.dir] if self.cfg.trainer.sync.dir else [])]
        gone = [folder for pid in pids for root in roots for folder in remove_dead_writer(pid, root)]
        if gone:
            log.info("removed the shared-memory weights of dead trainer ranks: %s", ", ".join(map(str, gone)))
        return gone

    def node_alive(self, node: str) -> bool:
        import ray

        return any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())

    def replace_engine(self, box: Box, wait_s: float = PLACE_WAIT_S) -> str:
        """An engine whose host actor died (with its node, or alone): the router drops its URL;
        where Ray places the engine's bundle again (a node left with room), a new engine starts
        there with the weights the others hold and joins the router; otherwise the run goes on
        with the engines left. The trainer's weight syncs follow either way. Returns what was done.
        """
        import ray

        index = self.engines.index(box)
        self.engines.pop(index)
        self.sync_router()  # no call goes to the dead URL from here on
        ray.kill(box.actor)  # Ray reports it dead: nothing of it may come back
        node = self._bundle_node(box.options, wait_s)
        if node is None:
            if not self.engines:
                raise RunFailed(f"{box.name}'s host died and no node has room for an engine: no engine left")
            self.left_out.append(box)  # first: a trainer rank that dies while told is rebuilt without it
            self._tell_trainer_engines()
            left = ", ".join(b.name for b in self.engines)
            return (
                f"no live node has room for it: the run goes on with {len(self.engines)} engine(s) ({left}); "
                "the router and the trainer's weight syncs no longer reach it until a node with room joins"
            )
        return self._start_again(box, node, index)

    def _start_again(self, box: Box, node: str, index: int) -> str:
        """A new engine for dead `box` on `node` (where Ray placed its bundle), at `index` of the
        engines, with the weights the others hold, in the router and the trainer's syncs."""
        import ray

        assert self.engine_start is not None
        fresh = Box(box.name, ray.remote(ServerHost).options(**box.options).remote(box.name, self.log_dir),
                    log=box.log, options=box.options, node=node)  # fmt: skip
        start = fresh.actor.start_engine.remote(*self.engine_start, 1800.0)
        fresh.url = self._get_all([start], f"starting {box.name} again")[0]
        self.engines.insert(index, fresh)
        weights = self.bring_engine_up_to_date(fresh)
        self.sync_router()
        self._tell_trainer_engines()  # last: a rank dead meanwhile is rebuilt with these engines
        return f"started again on node {node[:8]} at {fresh.url}; {weights}"

    def _tell_trainer_engines(self) -> None:
        """The trainer's weight syncs reach the engines live now. A rank that died raises Ray's
        `RayActorError` unchanged, for the supervisor to rebuild the trainer (with these engines:
        `replace_trainer` builds it with them); any other failure ends the run, named."""
        import ray

        try:
            ray.get(self.trainer_call("set_engines", [b.url for b in self.engines]))
        except ray.exceptions.RayActorError:
            raise
        except ray.exceptions.RayError as exc:
            raise RunFailed(f"telling the trainer failed: {root_cause(exc)}") from None

    def rejoin_engines(self) -> list[tuple[str, str]]:
        """Each left-out engine whose bundle Ray has since placed on a live node (a node with room
        joined) started there (`_start_again`), in its place among the engines (by number):
        [(name, what was done)]. Asks Ray once per left-out engine and waits for nothing else."""
        done = []
        for box in list(self.left_out):
            node = self._placed_node(box.options)
            if node is None:
                continue
            self.left_out.remove(box)
            number = _engine_number(box.name)
            index = sum(_engine_number(b.name) < number for b in self.engines)
            done.append((box.name, self._start_again(box, node, index)))
        return done

    def _placed_node(self, options: dict[str, Any]) -> str | None:
        """The live node holding the placement-group bundle an engine's `options` name; None when
        Ray has not placed it on one (or it has no bundle)."""
        from ray.util.placement_group import placement_group_table

        strategy = options.get("scheduling_strategy")
        group = getattr(strategy, "placement_group", None)
        if group is None:  # every engine has a bundle (`placement.place`); a stand-in has none
            return None
        index = getattr(strategy, "placement_group_bundle_index", -1)
        node = placement_group_table(group)["bundles_to_node_id"].get(index) or ""
        return node if node and self.node_alive(node) else None

    def _bundle_node(self, options: dict[str, Any], wait_s: float) -> str | None:
        """The live node holding the placement-group bundle an engine's `options` name, once Ray
        has placed it again (at once when only the actor died); None when no live node has room
        for it (seen for a second: Ray may be placing it meanwhile) or after `wait_s`."""
        strategy = options.get("scheduling_strategy")
        group = getattr(strategy, "placement_group", None)
        if group is None:  # every engine has a bundle (`placement.place`); a stand-in has none
            return None
        spec = group.bundle_specs[getattr(strategy, "placement_group_bundle_index", -1)]
        deadline, no_room_since = time.monotonic() + wait_s, None
        while time.monotonic() < deadline:
            node = self._placed_node(options)
            if node is not None:
                return node
            if self._room_for(spec):
                no_room_since = None
            elif no_room_since is None:
                no_room_since = time.monotonic()
            elif time.monotonic() - no_room_since >= 1.0:
                return None
            time.sleep(0.2)
        return None

    @staticmethod
    def _room_for(demand: dict[str, Any]) -> bool:
        """Whether some live node has `demand` (a bundle: resource -> amount) free now."""
        from ray._private.state import available_resources_per_node  # no public per-node view in Ray 2.x

        wanted = {k: float(v) for k, v in demand.items() if isinstance(v, int | float) and v}
        return any(
            all(free.get(k, 0.0) >= v for k, v in wanted.items())
            for free in available_resources_per_node().values()
        )

    def sync_router(self) -> None:
        """Makes the router's workers (sglang-router's `/workers`) the live engines: the dead one's
        URL out, a replacement's in; after a router restart (which starts with the first list),
        the same. The gateway reads that list too (its placement follows within seconds)."""
        assert self.router is not None
        want = [b.url.rstrip("/") for b in self.engines if b.url]
        try:
            self._set_router_workers(want)
        except httpx.TransportError as exc:
            # a router that cannot be reached is dead (or dying): the liveness check restarts it
            # with the engines live then (`restart_args`), so the list it would be told is its own
            log.warning(
                "router %s unreachable while setting its workers (%s: %s): its restart lists the engines live then",
                self.router.url, type(exc).__name__, exc,
            )  # fmt: skip

    def _set_router_workers(self, want: list[str]) -> None:
        assert self.router is not None
        with httpx.Client(timeout=30, trust_env=False) as client:
            listed = client.get(f"{self.router.url}/workers")
            listed.raise_for_status()
            ids = {w["url"].rstrip("/"): w["id"] for w in listed.json()["workers"]}
            for url, worker in ids.items():
                if url not in want:
                    client.delete(f"{self.router.url}/workers/{worker}").raise_for_status()
            for url in want:
                if url not in ids:
                    client.post(f"{self.router.url}/workers", json={"url": url}).raise_for_status()

    def bring_engine_up_to_date(self, box: Box) -> str:
        """A restarted engine gets the weights the others hold (`engine_weights`); what was done."""
        from palaestra.trainer.weight_sync import WeightSync

        version, directory = self.engine_weights or ("", None)
        if not version:
            return "its start-up weights are the run's (no weight sync yet)"
        if directory is None:  # no file of the synced weights (sync.mode tensor / distributed)
            directory = f"{self.log_dir}/recovery-weights-v{version}"
            self._get_all(self.trainer_call("export_hf", directory), "exporting the weights")
        tr = self.cfg.trainer
        # mode "tensor": no shared file of its own to set up; load_directory is the same in every mode
        with WeightSync(
            [box.url], mode="tensor", retries=tr.sync.retries, timeout_s=tr.sync.timeout_s
        ) as sync:
            if tr.lora.enabled:  # the base is the engine's own: only the adapter the others hold
                sync.load_adapter_directory(directory, tr.lora.name, version)
                return f"LoRA adapter {tr.lora.name!r} of weight version {version} loaded from {directory}"
            sync.load_directory(directory, version)
        return f"weight version {version} loaded from {directory}"

    # -- the engines' weights ------------------------------------------------------------------
    def _weight_sync(self):
        from palaestra.trainer.weight_sync import WeightSync

        tr = self.cfg.trainer
        return WeightSync(
            [b.url for b in self.engines],
            retries=tr.sync.retries,
            timeout_s=tr.sync.timeout_s,
            pause_mode=tr.sync.pause_mode,
        )

    def engine_versions(self) -> list[str]:
        """Each engine's weight version (`/get_weight_version`, or `/model_info` where that is a 404)."""
        sync = self._weight_sync()
        with httpx.Client(timeout=30, trust_env=False) as client:
            return [sync.read_version(client, b.url) for b in self.engines]

    def load_engine_weights(self, model_dir: str | Path, version: str) -> None:
        """Every engine loads the HF directory `model_dir` as `version`, the way the trainer's
        weight sync does it (pause, update, flush, version check, continue)."""
        self._weight_sync().load_directory(model_dir, version)

    # -- the gateway's admin and metrics -------------------------------------------------------
    def pause_gateway(self, timeout_s: float, drain: bool = True) -> dict[str, Any]:
        """New generation calls wait; with `drain`, returns once in-flight calls finished (or
        `timeout_s`), else at once (partial rollouts: the sync's pause-abort interrupts them)."""
        assert self.gateway is not None
        self.gateway_paused = True  # before the call: a gateway that dies during it comes back paused
        with httpx.Client(timeout=timeout_s + 30, trust_env=False) as client:
            r = client.post(
                f"{self.gateway.url}/admin/pause",
                params={"wait": "true" if drain else "false", "timeout_s": timeout_s},
                headers={"Authorization": f"Bearer {self.admin_key}"},
            )
            r.raise_for_status()
            return r.json()

    def resume_gateway(self) -> None:
        assert self.gateway is not None
        with httpx.Client(timeout=60, trust_env=False) as client:
            r = client.post(
                f"{self.gateway.url}/admin/resume", headers={"Authorization": f"Bearer {self.admin_key}"}
            )
            r.raise_for_status()
        self.gateway_paused = False

    def restart_args(self, box: Box) -> list[str]:
        """What a restart of `box` adds to its command: the gateway starts paused while the run
        holds it paused (the weights on the engines are changing); the router starts with the
        engines live now when they differ from those it started with (an engine's node died)."""
        if box is self.router:
            live = [b.url for b in self.engines if b.url]
            return ["--worker-urls", *live] if live != self.router_urls else []
        return ["--start-paused"] if box in self.gateway_shards and self.gateway_paused else []

    def gateway_overhead_s(self) -> float:
        """Total gateway time outside the engine so far (its Prometheus histogram's sum, over every
        shard: the front labels each shard's)."""
        assert self.gateway is not None
        try:
            with httpx.Client(timeout=30, trust_env=False) as client:
                r = client.get(
                    f"{self.gateway.url}/metrics", headers={"Authorization": f"Bearer {self.api_key}"}
                )
        except httpx.HTTPError:  # the gateway is down (its supervisor restarts it): no figure now
            return 0.0
        return sum(
            float(line.split()[-1])
            for line in r.text.splitlines()
            if line.startswith("palaestra_gateway_call_overhead_seconds_sum")
        )

    # -- the trainer (every rank is called; rank 0 answers) -------------------------------------
    def trainer_call(self, method: str, *args: Any, rank0_args: tuple | None = None) -> list:
        """Refs of `method` on every rank; `rank0_args` replaces `args` on rank 0 (the samples)."""
        return [
            getattr(w, method).remote(*(rank0_args if rank == 0 and rank0_args is not None else args))
            for rank, w in enumerate(self.trainer)
        ]

    def stop(self) -> None:
        """Stops everything this cluster started (servers first, politely; then the actors)."""
        import ray

        if self.rollout is not None:
            try:
                ray.get(self.rollout.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 (stopping: report nothing, kill below)
                pass
        for box in reversed(self.servers):
            try:
                ray.get(box.actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        for actor in [self.rollout, *self.trainer, *(b.actor for b in self.servers)]:
            if actor is not None:
                ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement.group)


# ----------------------------------------------------------------------------------------------
# A run's cluster, from the models to the last actor
# ----------------------------------------------------------------------------------------------
def interrupting(cfg: RunConfig) -> bool:
    """Whether weight syncs interrupt generations in flight (async mode's partial rollouts)."""
    return cfg.run.mode == "async" and cfg.run.partial_rollouts


def trainer_options(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's options as its ranks get them: with partial rollouts its weight syncs pause the
    engines in abort mode (the interrupted calls come back with their tokens; the gateway goes on)."""
    options = cfg.trainer.to_dict()
    if interrupting(cfg):
        options["sync"]["pause_mode"] = "abort"
    return options


def lora_engine_flags(cfg: RunConfig) -> list[str]:
    """With trainer.lora: the engine flags that serve its adapter (SGLang's names, in both
    backends), except those engines.engine / engines.sglang already set."""
    lora = cfg.trainer.lora
    if not lora.enabled:
        return []
    from palaestra.trainer.lora import resolve_targets

    wanted = {"enable_lora": True}
    if cfg.engines.backend == "sglang":  # SGLang sizes its adapter memory pool from these
        wanted |= {"max_lora_rank": lora.rank, "lora_target_modules": list(resolve_targets(lora.targets))}
    given = cfg.engines.engine if cfg.engines.backend == "embedded" else cfg.engines.sglang
    prefix = "--" if cfg.engines.backend == "embedded" else "--sglang-"
    return to_flags({k: v for k, v in wanted.items() if k not in given}, prefix)


def routing_engine_flags(cfg: RunConfig) -> list[str]:
    """With trainer.routing_replay r3 (the trainer replays the rollout's experts): the engine flag
    that lets requests ask for them (SGLang's name, in both backends), unless already set."""
    if cfg.trainer.routing_replay != "r3":
        return []
    given = cfg.engines.engine if cfg.engines.backend == "embedded" else cfg.engines.sglang
    prefix = "--" if cfg.engines.backend == "embedded" else "--sglang-"
    return (
        []
        if "enable_return_routed_experts" in given
        else to_flags({"enable_return_routed_experts": True}, prefix)
    )


def lora_gateway_flags(cfg: RunConfig) -> list[str]:
    """With trainer.lora: the gateway names the adapter in every engine call."""
    lora = cfg.trainer.lora
    return ["--engine-lora-adapter", lora.name] if lora.enabled else []


def routing_gateway_flags(cfg: RunConfig) -> list[str]:
    """With trainer.routing_replay r3: every engine call asks its routed experts, which the samples
    carry (a gateway option the run config already turned on gives its flag itself)."""
    if cfg.trainer.routing_replay == "r3" and not cfg.gateway.return_routed_experts:
        return ["--return-routed-experts"]
    return []


def build_models(cfg: RunConfig) -> None:
    """Builds the presets the run names (the demo's warm-started teacher and student take ~2 min
    the first time) here, with progress on the console, before any actor asks for them."""
    from palaestra.models import PRESETS, resolve_model

    for name in dict.fromkeys([cfg.model.student, cfg.model.teacher, cfg.trainer.opd.teacher_model]):
        if name in PRESETS:
            t0 = time.perf_counter()
            path = resolve_model(name)
            log.info("model %s: %s (%.1f s)", name, path, time.perf_counter() - t0)


@contextmanager
def start_cluster(cfg: RunConfig, *, weight_version: int, output_dir: Path) -> Iterator[Cluster]:
    """The models, Ray (unless one runs already) and every box, engines at `weight_version`;
    servers log to `output_dir/logs`, the gateway spools to `output_dir/spool`. Everything this
    started stops when the block ends, however it ends."""
    build_models(cfg)
    t0 = time.perf_counter()
    started_ray = init_ray(cfg.run.host, logical_cpus_needed(cfg), cfg.run.ray_address)
    ray_s = time.perf_counter() - t0
    cluster = Cluster(cfg)
    try:
        cluster.start(
            weight_version=weight_version,
            spool_dir=str(output_dir / "spool"),
            log_dir=str(output_dir / "logs"),
        )
        cluster.startup_s["ray"] = ray_s
        up = cluster.startup_s
        log.info(
            "up: Ray %.1f s, engines %.1f s, router+gateway %.1f s, environment+trainer %.1f s; "
            "engines %s, router %s, gateway %s",
            ray_s,
            up["engines"],
            up["servers"] - up["engines"],
            up["all"] - up["servers"],
            ", ".join(b.url for b in cluster.engines),
            cluster.router.url,
            cluster.gateway.url,
        )
        yield cluster
    finally:
        cluster.stop()
        if started_ray:
            import ray

            ray.shutdown()
