"""Torch's thread count in a trainer rank: the driver's OMP_NUM_THREADS when set, else the cores."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.orchestrator import trainer_worker
from palaestra.orchestrator.cluster import Cluster
from palaestra.orchestrator.placement import (
    RayPlacement,
    engine_threads_beside_trainer,
    engines_beside_trainer,
)
from palaestra.orchestrator.trainer_worker import torch_threads

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_omp_num_threads_wins_over_the_cores(monkeypatch):
    monkeypatch.setattr(trainer_worker.os, "cpu_count", lambda: 16)
    assert torch_threads(0, 1, "1") == 1
    assert torch_threads(4, 2, "3") == 3  # per rank, as OpenMP reads it in each process
    assert torch_threads(0, 1, " 4,2 ") == 4  # the nested form: the outer level


def test_unset_shares_the_cores_less_the_engines(monkeypatch):
    monkeypatch.setattr(trainer_worker.os, "cpu_count", lambda: 16)
    assert torch_threads(4, 2, None) == 6
    assert torch_threads(0, 1, "") == 16
    assert torch_threads(16, 1, None) == 1  # never below one
    monkeypatch.setattr(trainer_worker.os, "cpu_count", lambda: None)
    assert torch_threads(0, 1, None) == 1


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", ",4"])
def test_a_bad_value_is_named(bad):
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.* is not a positive integer"):
        torch_threads(0, 1, bad)


def test_the_driver_passes_its_value_to_every_rank(monkeypatch):
    """Inside the actor Ray has set OMP_NUM_THREADS to the actor's CPUs: the driver's goes as an argument."""
    started = []

    class Remote:
        def options(self, **opts):
            return types.SimpleNamespace(remote=lambda *args: started.append(args))

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(remote=lambda cls: Remote()))
    cluster = object.__new__(Cluster)
    cluster.cfg = load_config(CONFIG, ["trainer.dp_size=2"])
    cluster.placement = types.SimpleNamespace(trainer=[{}, {}])
    monkeypatch.setattr(Cluster, "_engines_beside_trainer", lambda self: 2)  # Ray's placement table
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cluster._start_trainer()
    assert [a[0] for a in started] == [0, 1] and {a[3] for a in started} == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='zero'"):
        cluster._start_trainer()
    monkeypatch.delenv("OMP_NUM_THREADS")
    started.clear()
    cluster._start_trainer()
    assert {a[3] for a in started} == {None}


def _placed(trainer: list[int], engines: list[int]) -> RayPlacement:
    """A `RayPlacement` whose actors name these bundle indices (what `place` gives them)."""

    def at(i: int) -> dict:
        return {"scheduling_strategy": types.SimpleNamespace(placement_group_bundle_index=i)}

    return RayPlacement(None, [at(i) for i in trainer], [at(i) for i in engines])


def test_engines_on_the_trainers_node_keep_their_threads_on_a_cluster_too():
    """`run.ray_address` joins a cluster, which may be this one node (`ray start --head`, address
    auto): decoupled PACK then puts the engines beside the trainer, which must leave them their
    threads (it left none: every ray_address counted as engines elsewhere). Ray's placement table
    says where each bundle went."""
    decoupled = _placed([0], [1, 2])  # bundle 0: the trainer rank, 1 and 2: the engines
    one_node = {0: "n0", 1: "n0", 2: "n0"}
    assert engines_beside_trainer(decoupled, one_node) == 2
    assert engines_beside_trainer(decoupled, {0: "n0", 1: "n1", 2: "n1"}) == 0
    assert engines_beside_trainer(decoupled, {0: "n0", 1: "n0", 2: "n1"}) == 1
    assert engines_beside_trainer(decoupled, {1: "n0"}) == 0  # the trainer's bundle not placed (yet)
    assert engines_beside_trainer(_placed([0, 0], [0, 0]), {0: "n0"}) == 2  # colocated: one bundle
    overlapping = ["run.mode=one_step_off", "run.placement=decoupled"]
    for address in ("run.ray_address=auto", "run.ray_address=null"):
        cfg = load_config(CONFIG, [*overlapping, address])
        assert engine_threads_beside_trainer(cfg, engines_beside_trainer(decoupled, one_node)) == 2
        assert engine_threads_beside_trainer(cfg, 0) == 0  # the engines on other nodes
    assert engine_threads_beside_trainer(load_config(CONFIG, ["run.ray_address=auto"]), 2) == 0  # sync
