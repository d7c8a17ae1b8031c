"""Where the boxes go (`run.placement`) and how many CPU threads each gets.

*colocated* puts the trainer ranks and the engines in one STRICT_PACK placement group that they
time-share (fractional resources, on CPU and on GPU); *decoupled* gives each trainer rank and each
engine bundles of its own (PACK). The router, the gateway and the rollout worker are light (no
reserved resources) and go wherever Ray puts them. `Cluster.start` (cluster.py) uses `place`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from palaestra.config import RunConfig
from palaestra.orchestrator.errors import RunFailed

__all__ = [
    "Placement",
    "engine_threads_beside_trainer",
    "logical_cpus_needed",
    "place",
    "trainer_world_size",
]


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
