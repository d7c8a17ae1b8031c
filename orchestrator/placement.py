"""Where the boxes go (`run.placement`) and how many CPU threads each gets.

*colocated* puts the trainer ranks and the engines in one STRICT_PACK placement group that they
time-share (fractional resources, on CPU and on GPU); *decoupled* gives each trainer rank
(`trainer.dp_size` × tensor-parallel size of them) and each engine bundles of its own (PACK: on
as few nodes as fit, spread when they do not). `run.resources` adds Ray resource demands to the
bundles (`trainer`, `engines`) and to the light boxes (`services`: router, gateway, rollout
worker, which reserve no CPU), so that custom node resources decide which node runs what.
`Cluster.start` (cluster.py) uses `place` and prints where every box landed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from palaestra.config import RunConfig
from palaestra.orchestrator.errors import RunFailed

__all__ = [
    "RayPlacement",
    "engine_threads_beside_trainer",
    "engines_beside_trainer",
    "logical_cpus_needed",
    "place",
    "trainer_world_size",
]


def trainer_world_size(cfg: RunConfig) -> int:
    """Trainer ranks: `trainer.dp_size` data-parallel replicas × the Megatron tensor- and
    pipeline-parallel sizes (expert-parallel ranks are data-parallel ones)."""
    megatron = cfg.trainer.megatron
    tp = int(megatron.get("tensor_model_parallel_size") or 1)
    return cfg.trainer.dp_size * tp * int(megatron.get("pipeline_model_parallel_size") or 1)


def _with(bundle: dict[str, float], *extra: dict[str, float]) -> dict[str, float]:
    """`bundle` plus `run.resources` demands (the largest where two name the same resource)."""
    out = dict(bundle)
    for demands in extra:
        for key, value in demands.items():
            out[key] = max(out.get(key, 0.0), float(value))
    return out


@dataclass
class RayPlacement:
    group: Any  # ray PlacementGroup
    trainer: list[dict[str, Any]]  # actor options per trainer rank
    engines: list[dict[str, Any]]  # actor options per engine


def place(cfg: RunConfig, gpus: int) -> RayPlacement:
    """Bundles and per-actor options for `run.placement` (see the module docstring)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world, count = trainer_world_size(cfg), cfg.engines.count
    # custom resources pin bundles to nodes; the actors then only ask for their CPU/GPU share
    on_trainer, on_engines = cfg.run.resources.get("trainer", {}), cfg.run.resources.get("engines", {})
    engine_gpus = int(cfg.engines.sglang.get("tp_size") or cfg.engines.sglang.get("tp") or 1)
    if cfg.run.placement == "colocated":
        if gpus:
            if engine_gpus != 1:
                raise RunFailed("colocated placement shares one GPU per engine: use tp_size 1 or decoupled")
            slots = max(world, count)
            bundles = [_with({"GPU": 1, "CPU": 1}, on_trainer, on_engines) for _ in range(slots)]
            share = {"num_gpus": 0.5, "num_cpus": 0.5}
            trainer = [(r % slots, share) for r in range(world)]
            engines = [(i % slots, share) for i in range(count)]
        else:  # one bundle, time-shared by every trainer rank and engine
            bundles = [_with({"CPU": 1}, on_trainer, on_engines)]
            share = {"num_cpus": 1 / (world + count)}
            trainer = [(0, share) for _ in range(world)]
            engines = [(0, share) for _ in range(count)]
        strategy = "STRICT_PACK"
    else:
        unit = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        bundles = [_with(unit, on_trainer) for _ in range(world)]
        bundles += [
            _with({"GPU": engine_gpus, "CPU": 1} if gpus else {"CPU": 1}, on_engines) for _ in range(count)
        ]
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

    return RayPlacement(
        group, [options(i, res) for i, res in trainer], [options(i, res) for i, res in engines]
    )


def engines_beside_trainer(placement: RayPlacement, bundle_nodes: dict[int, str]) -> int:
    """How many engines Ray placed on a node that runs a trainer rank. `bundle_nodes`: each
    bundle's node (Ray's placement-group table, once the group is ready). Colocated, every engine;
    decoupled, those PACK put beside the trainer: all on a one-node cluster (`run.ray_address:
    auto` after `ray start --head`), none where the engines' bundles filled other nodes."""

    def node(options: dict[str, Any]) -> str | None:
        return bundle_nodes.get(options["scheduling_strategy"].placement_group_bundle_index)

    trainer_nodes = {node(o) for o in placement.trainer} - {None}
    return sum(node(o) in trainer_nodes for o in placement.engines)


def engine_threads_beside_trainer(cfg: RunConfig, engines_beside: int) -> int:
    """CPU threads the trainer leaves to the `engines_beside` engines on its machine
    (`engines_beside_trainer`; its ranks share the rest).

    In sync mode the engines idle while the trainer trains, so it takes every core. In the
    overlapping modes it leaves each engine beside it `engines.engine.num_threads` (all of them
    half the cores when unset): on the 2-core development machine one trainer thread beside two
    1-thread engines made one-step-off steps ~15% faster than two oversubscribed threads.
    """
    if cfg.run.mode == "sync" or not engines_beside or cfg.engines.backend != "embedded":
        return 0
    per_engine = cfg.engines.engine.get("num_threads")
    return int(per_engine) * engines_beside if per_engine else (os.cpu_count() or 2) // 2


def logical_cpus_needed(cfg: RunConfig) -> int:
    """Logical CPUs the placement reserves (Ray's scheduling unit, not threads): a 2-core machine
    still runs a decoupled run, the cores being shared by threads."""
    bundles = 1 if cfg.run.placement == "colocated" else trainer_world_size(cfg) + cfg.engines.count
    return max(os.cpu_count() or 1, bundles + 1)
