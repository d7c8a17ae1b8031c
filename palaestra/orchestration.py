"""Ray orchestration of a training run: start Ray, place the boxes, watch them, feed the trainer.

* `init_ray` — a local Ray bound to loopback (or the cluster in ``RAY_ADDRESS``).
* `Cluster` — starts the engines, the router, the gateway, the rollout worker and the trainer
  ranks as Ray actors (`palaestra.actors`) in a placement group, hands out their URLs, checks that
  they are alive, and stops them all. Nothing here assumes one machine: every URL comes from the
  actor that runs the server.
* `SampleFeed` — the trainer's side of the gateway's durable `/samples` cursor: deduplicates by
  `sample_id`, drops failed/aborted samples (counted), and hands out a finished group's samples.
* `select_batch` — what of the finished groups trains: the staleness bound (drop or mask), the
  optional zero-reward-variance filter, with every decision counted.
* `Waiter` — every wait of the loop: bounded by the step deadline, and between polls it checks
  that each engine, the router and the gateway still run, so nothing hangs silently.

Placement (`run.placement`): *colocated* puts the trainer ranks and the engines in one STRICT_PACK
group that they time-share (fractional resources, on CPU and on GPU); *decoupled* gives each trainer
rank and each engine bundles of its own (PACK). The router, the gateway and the rollout worker are
light (no reserved resources) and go wherever Ray puts them.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from palaestra.actors import GroupRecord
from palaestra.config import RunConfig
from palaestra.sample import Sample

__all__ = [
    "Cluster",
    "RunFailed",
    "SampleFeed",
    "StepTimeout",
    "Waiter",
    "init_ray",
    "sample_lag",
    "select_batch",
]

log = logging.getLogger("palaestra.train")

TRAINABLE = ("completed", "truncated")


class RunFailed(RuntimeError):
    """The run cannot go on: the message says which box failed, in which phase, and where its log is."""


class StepTimeout(RunFailed):
    """A step took longer than `run.step_timeout_s`."""


# ----------------------------------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------------------------------
def init_ray(host: str = "127.0.0.1", num_cpus: int | None = None) -> bool:
    """Starts a local Ray (or connects to ``RAY_ADDRESS``); returns True if this call started it.

    On loopback every Ray process binds 127.0.0.1: Ray resolves a `_node_ip_address` of 127.0.0.1
    to the machine's outward IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` ("single-node Ray",
    which Linux allows too), so that is set before Ray is imported. Also off: the dashboard, usage
    stats. Ray's GCS, raylet, object manager and workers then listen on 127.0.0.1 only.
    """
    if host in ("127.0.0.1", "localhost") and not os.environ.get("RAY_ADDRESS"):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
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
# Placement
# ----------------------------------------------------------------------------------------------
def trainer_world_size(cfg: RunConfig) -> int:
    """Trainer ranks: the Megatron model-parallel size (data parallelism across actors is not
    wired yet; one rank trains on CPU)."""
    return int(cfg.trainer.megatron.get("tensor_model_parallel_size") or 1)


@dataclass
class Placement:
    group: Any  # ray PlacementGroup
    trainer: list[dict[str, Any]]  # actor options per trainer rank
    engines: list[dict[str, Any]]  # actor options per engine


def place(cfg: RunConfig, gpus: int) -> Placement:
    """Bundles and per-actor options for `run.placement` (see the module docstring)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world, count = trainer_world_size(cfg), cfg.engines.count
    engine_gpus = int(cfg.engines.sglang.get("tp_size") or cfg.engines.sglang.get("tp") or 1)
    if cfg.run.placement == "colocated":
        if gpus:
            if engine_gpus != 1:
                raise RunFailed("colocated placement shares one GPU per engine: use tp_size 1 or decoupled")
            slots = max(world, count)
            bundles = [{"GPU": 1, "CPU": 1} for _ in range(slots)]
            share = {"num_gpus": 0.5, "num_cpus": 0.5}
            trainer = [(r % slots, share) for r in range(world)]
            engines = [(i % slots, share) for i in range(count)]
        else:  # one bundle, time-shared by every trainer rank and engine
            bundles = [{"CPU": 1}]
            share = {"num_cpus": 1 / (world + count)}
            trainer = [(0, share) for _ in range(world)]
            engines = [(0, share) for _ in range(count)]
        strategy = "STRICT_PACK"
    else:
        unit = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        bundles = [dict(unit) for _ in range(world)]
        bundles += [{"GPU": engine_gpus, "CPU": 1} if gpus else {"CPU": 1} for _ in range(count)]
        trainer = [(r, {"num_cpus": 1, **({"num_gpus": 1} if gpus else {})}) for r in range(world)]
        engines = [
            (world + i, {"num_cpus": 1, **({"num_gpus": engine_gpus} if gpus else {})}) for i in range(count)
        ]
        strategy = "PACK"
    group = placement_group(bundles, strategy=strategy, name=f"palaestra-{cfg.run.name}")

    def options(index: int, resources: dict[str, float]) -> dict[str, Any]:
        return {
            **resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        }

    return Placement(group, [options(i, res) for i, res in trainer], [options(i, res) for i, res in engines])


def engine_threads_beside_trainer(cfg: RunConfig) -> int:
    """CPU threads the trainer leaves to engines on its machine (its ranks share the rest).

    In sync mode the engines idle while the trainer trains, so it takes every core. In the
    overlapping modes, when engines share its machine (colocated, or a local run), it leaves them
    `engines.engine.num_threads` each (half the cores when unset): on the 2-core development
    machine one trainer thread beside two 1-thread engines made one-step-off steps ~15% faster
    than two oversubscribed threads.
    """
    local = cfg.run.placement == "colocated" or not os.environ.get("RAY_ADDRESS")
    if cfg.run.mode == "sync" or not local or cfg.engines.backend != "embedded":
        return 0
    per_engine = cfg.engines.engine.get("num_threads")
    return int(per_engine) * cfg.engines.count if per_engine else (os.cpu_count() or 2) // 2


def logical_cpus_needed(cfg: RunConfig) -> int:
    """Logical CPUs the placement reserves (Ray's scheduling unit, not threads): a 2-core machine
    still runs a decoupled run, the cores being shared by threads."""
    bundles = 1 if cfg.run.placement == "colocated" else trainer_world_size(cfg) + cfg.engines.count
    return max(os.cpu_count() or 1, bundles + 1)


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


@dataclass
class Cluster:
    cfg: RunConfig
    engines: list[Box] = field(default_factory=list)
    router: Box | None = None
    gateway: Box | None = None
    rollout: Any = None
    trainer: list[Any] = field(default_factory=list)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    placement: Placement | None = None
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def servers(self) -> list[Box]:
        return [
            *self.engines,
            *([self.router] if self.router else []),
            *([self.gateway] if self.gateway else []),
        ]

    def start(self, *, weight_version: int, run_id: str, spool_dir: str, log_dir: str) -> Cluster:
        """Engines (while the trainer ranks import Megatron) → router, gateway, environment (while
        the trainer builds its model) → done. Engines start at `weight_version`."""
        import ray

        from palaestra import actors

        cfg = self.cfg
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
        server = ray.remote(actors.ServerHost)
        flags = cfg.engines.serve_flags() if cfg.engines.backend == "embedded" else cfg.engines.sglang_flags()
        for i, opts in enumerate(self.placement.engines):
            name = f"engine-{i}"
            self.engines.append(
                Box(name, server.options(**opts).remote(name, log_dir), log=f"{log_dir}/{name}.log")
            )
        self.trainer = self._start_trainer()  # imports megatron-core while the engines load
        engine_refs = [
            b.actor.start_engine.remote(
                cfg.engines.backend, cfg.model.student, flags, cfg.run.host, str(weight_version), 1800.0
            )
            for b in self.engines
        ]
        for box, url in zip(self.engines, self._get_all(engine_refs, "starting the engines"), strict=True):
            box.url = url
        self.startup_s["engines"] = time.perf_counter() - t0
        urls = [b.url for b in self.engines]
        building = self.trainer_call("build", cfg.trainer.to_dict(), cfg.model.student, urls)
        light = server.options(num_cpus=0)
        self.router = Box("router", light.remote("router", log_dir), log=f"{log_dir}/router.log")
        self.router.url = self._get_all(
            [
                self.router.actor.start_router.remote(
                    [b.url for b in self.engines], cfg.router_flags(), cfg.run.host
                )
            ],
            "starting the router",
        )[0]
        self.gateway = Box("gateway", light.remote("gateway", log_dir), log=f"{log_dir}/gateway.log")
        keys = {"PALAESTRA_API_KEY": self.api_key, "PALAESTRA_ADMIN_KEY": self.admin_key}
        self.gateway.url = self._get_all(
            [
                self.gateway.actor.start_gateway.remote(
                    cfg.model.student,
                    self.router.url,
                    spool_dir,
                    cfg.gateway.serve_flags(),
                    cfg.run.host,
                    keys,
                )
            ],
            "starting the gateway",
        )[0]
        self.startup_s["servers"] = time.perf_counter() - t0
        rollout = ray.remote(actors.RolloutWorker).options(num_cpus=0, max_concurrency=1000)
        self.rollout = rollout.remote(
            cfg.env.name,
            {k: v for k, v in cfg.env.args.items() if k != "temperature"},
            cfg.trainer.temperature,
            self.gateway.url,
            self.api_key,
            cfg.run.seed,
            cfg.env.samples_per_task,
            cfg.env.concurrency,
            run_id,
        )
        info = self._get_all([self.rollout.info.remote()], "starting the environment")[0]
        if not info["sets_temperature"]:
            log.warning(
                "environment %r has no `temperature` attribute: make sure it samples at "
                "trainer.temperature=%g, or the trainer's logprobs will not match the rollout's",
                cfg.env.name,
                cfg.trainer.temperature,
            )
        self._get_all(building, "building the trainer")
        self.startup_s["all"] = time.perf_counter() - t0
        return self

    def _start_trainer(self) -> list[Any]:
        import ray

        from palaestra import actors
        from palaestra.net import free_port

        world = trainer_world_size(self.cfg)
        master = "127.0.0.1" if world == 1 else ray.util.get_node_ip_address()
        port = free_port("127.0.0.1") if world == 1 else free_port(master)
        worker = ray.remote(actors.TrainerWorker)
        reserve = engine_threads_beside_trainer(self.cfg)
        assert self.placement is not None
        return [
            worker.options(**opts).remote(rank, world, master, port, reserve)
            for rank, opts in enumerate(self.placement.trainer)
        ]

    def _get_all(self, refs: list, phase: str) -> list:
        """`ray.get` that turns an actor's failure into a RunFailed naming the phase."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RunFailed(f"{phase} failed: {_root_cause(exc)}") from None

    # -- liveness ------------------------------------------------------------------------------
    def check_alive(self, phase: str) -> None:
        """Raises RunFailed naming the first server whose process has exited (or whose actor died)."""
        import ray

        boxes = self.servers
        refs = [b.actor.poll.remote() for b in boxes]
        try:
            codes = ray.get(refs, timeout=30)
        except ray.exceptions.RayActorError as exc:
            raise RunFailed(f"{phase}: a server's actor died: {_root_cause(exc)}") from None
        for box, code in zip(boxes, codes, strict=True):
            if code is not None:
                tail = ray.get(box.actor.log_tail.remote(1500), timeout=30)
                raise RunFailed(
                    f"{box.name} ({box.url}) exited with code {code} during {phase}; the run stops. "
                    f"Log: {box.log}\n--- last output of {box.name} ---\n{tail.rstrip()}"
                )

    def engine_versions(self) -> list[str]:
        """Each engine's `/get_weight_version` (or `/model_info` where that is a 404)."""
        out = []
        with httpx.Client(timeout=30, trust_env=False) as client:
            for box in self.engines:
                r = client.get(f"{box.url}/get_weight_version")
                if r.status_code == 404:
                    r = client.get(f"{box.url}/model_info")
                r.raise_for_status()
                out.append(str(r.json()["weight_version"]))
        return out

    # -- the gateway's admin and metrics -------------------------------------------------------
    def pause_gateway(self, timeout_s: float) -> dict[str, Any]:
        """New generation calls wait; returns once in-flight calls finished (or `timeout_s`)."""
        assert self.gateway is not None
        with httpx.Client(timeout=timeout_s + 30, trust_env=False) as client:
            r = client.post(
                f"{self.gateway.url}/admin/pause",
                params={"wait": "true", "timeout_s": timeout_s},
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

    def gateway_overhead_s(self) -> float:
        """Total gateway time outside the engine so far (its Prometheus histogram's sum)."""
        assert self.gateway is not None
        with httpx.Client(timeout=30, trust_env=False) as client:
            r = client.get(f"{self.gateway.url}/metrics", headers={"Authorization": f"Bearer {self.api_key}"})
        for line in r.text.splitlines():
            if line.startswith("palaestra_gateway_call_overhead_seconds_sum"):
                return float(line.split()[-1])
        return 0.0

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


def _root_cause(exc: BaseException) -> str:
    """The innermost error of a Ray exception, one paragraph (not Ray's whole wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------
# Waiting, bounded and watched
# ----------------------------------------------------------------------------------------------
class Waiter:
    """Waits on Ray refs with the step's deadline, checking the servers between polls."""

    def __init__(self, cluster: Cluster, timeout_s: float, poll_s: float = 2.0):
        self.cluster, self.timeout_s, self.poll_s = cluster, timeout_s, poll_s
        self.deadline = math.inf
        self.label = "start-up"

    def start_step(self, step: int) -> None:
        self.begin(f"step {step + 1}")

    def begin(self, label: str) -> None:
        """A new bounded piece of work (a step, an evaluation, a checkpoint) named `label`."""
        self.label, self.deadline = label, time.monotonic() + self.timeout_s

    def get(self, refs: list, phase: str, *, progress: Callable[[], str] | None = None) -> list:
        import ray

        pending = list(refs)
        while pending:
            left = self.deadline - time.monotonic()
            if left <= 0:
                detail = f" ({progress()})" if progress is not None else ""
                raise StepTimeout(
                    f"{self.label} exceeded run.step_timeout_s={self.timeout_s:g} s during "
                    f"{phase}{detail}; the run stops"
                )
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(self.poll_s, left))
            if pending:
                self.cluster.check_alive(phase)
        try:
            return ray.get(list(refs))
        except ray.exceptions.RayError as exc:
            self.cluster.check_alive(phase)  # a dead engine explains a failed call best
            raise RunFailed(f"{self.label}, {phase}: {_root_cause(exc)}") from None

    def wait_until(self, ready: Callable[[], bool], phase: str, progress: Callable[[], str]) -> None:
        """Polls `ready()` until it holds, under the same deadline and liveness checks."""
        checked = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now >= self.deadline:
                raise StepTimeout(
                    f"{self.label} exceeded run.step_timeout_s={self.timeout_s:g} s during "
                    f"{phase} ({progress()}); the run stops"
                )
            if now - checked >= self.poll_s:
                self.cluster.check_alive(phase)
                checked = now
            time.sleep(0.1)


# ----------------------------------------------------------------------------------------------
# Samples: the gateway's cursor
# ----------------------------------------------------------------------------------------------
class SampleFeed:
    """Reads `/samples?after=CURSOR`, keeps trainable samples of this launch until their group is
    claimed. `cursor` is the last spool position read: everything up to it has been seen."""

    def __init__(self, gateway_url: str, api_key: str, run_id: str, cursor: int = 0):
        self.url, self.run_id, self.cursor = gateway_url.rstrip("/"), run_id, cursor
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.seen: set[str] = set()
        self.buffer: dict[str, Sample] = {}
        self.counts: Counter[str] = Counter()
        self.client = httpx.Client(timeout=60, trust_env=False, headers=self.headers)

    def close(self) -> None:
        self.client.close()

    def _ours(self, group_id: str) -> bool:
        # Group ids are `env/task_id/<run_id>.<task index>` (the rollout worker's run ids); samples
        # of another launch (a crashed attempt before a resume) or of evaluations are not trained.
        return group_id.rsplit("/", 1)[-1].startswith(self.run_id + ".")

    def poll(self) -> int:
        """Reads every sample after the cursor; returns how many were new."""
        new = 0
        while True:
            r = self.client.get(f"{self.url}/samples", params={"after": self.cursor, "limit": 1000})
            r.raise_for_status()
            page = r.json()
            for data in page["samples"]:
                new += self._take(data)
            self.cursor = int(page["cursor"])
            if not page["samples"] or self.cursor >= int(page["last_cursor"]):
                return new

    def _take(self, data: dict[str, Any]) -> int:
        sid = data["sample_id"]
        if sid in self.seen:
            self.counts["duplicates"] += 1
            return 0
        self.seen.add(sid)
        if not self._ours(data["group_id"]):
            evaluation = data["group_id"].rsplit("/", 1)[-1].startswith("eval-")
            self.counts["eval" if evaluation else "other_run"] += 1
            return 0
        if data["status"] not in TRAINABLE:
            self.counts[f"status_{data['status']}"] += 1
            return 0
        self.buffer[sid] = Sample.from_dict(data)
        return 1

    def claim(self, record: GroupRecord) -> list[Sample] | None:
        """The group's samples once all are read (None: poll again), removed from the buffer."""
        if not all(sid in self.buffer for sid in record.sample_ids):
            return None
        return [self.buffer.pop(sid) for sid in record.sample_ids]


# ----------------------------------------------------------------------------------------------
# What trains
# ----------------------------------------------------------------------------------------------
def sample_lag(sample: Sample, trainer_version: int) -> float:
    """Weight versions between the trainer and the oldest policy that sampled a token of `sample`
    (inf when a version is not a number, e.g. an engine left at "default")."""
    versions = [v for v, m in zip(sample.weight_versions, sample.loss_mask, strict=True) if m == 1]
    if not versions:
        return 0.0
    try:
        return float(trainer_version - min(int(v) for v in versions))
    except ValueError:
        return math.inf


@dataclass
class Batch:
    samples: list[Sample]  # what trains
    groups: list[GroupRecord]  # the groups they came from
    lags: list[float]  # per trained sample, in weight versions
    counts: Counter[str]  # stale_dropped, stale_masked, groups_zero_variance, zero_variance_samples, ...
    considered: list[GroupRecord] = field(default_factory=list)  # every group looked at (kept or not)

    def extend(self, other: Batch) -> None:
        self.samples += other.samples
        self.groups += other.groups
        self.lags += other.lags
        self.counts += other.counts
        self.considered += other.considered


def select_batch(
    groups: Sequence[tuple[GroupRecord, list[Sample]]],
    trainer_version: int,
    max_staleness: int,
    stale_policy: str,
    filter_zero_variance: bool,
) -> Batch:
    """Applies the staleness bound (per sample: drop, or keep with loss_mask zeroed) and the
    zero-reward-variance filter (per group, after the staleness drop); counts every decision."""
    batch = Batch([], [], [], Counter(), [record for record, _ in groups])
    for record, group in groups:
        fresh = []
        for s in group:
            lag = sample_lag(s, trainer_version)
            if lag > max_staleness:
                if stale_policy == "drop":
                    batch.counts["stale_dropped"] += 1
                    continue
                s = Sample.from_dict({**s.to_dict(), "loss_mask": [0] * s.response_len})
                batch.counts["stale_masked"] += 1
            fresh.append((s, lag))
        if not fresh:
            batch.counts["groups_empty"] += 1
            continue
        if filter_zero_variance and len({s.reward for s, _ in fresh}) == 1:
            batch.counts["groups_zero_variance"] += 1
            batch.counts["zero_variance_samples"] += len(fresh)
            continue
        batch.groups.append(record)
        batch.samples += [s for s, _ in fresh]
        batch.lags += [lag for _, lag in fresh]
    return batch
