"""The pieces that let a run outlive an engine's node, without Ray (issue 37; the Ray run that removes
nodes is tests/orchestrator/test_multinode.py): the router told which engines are left, the trainer's
weight syncs following them, the fault counted under its own kind, and the driver's halt test hook
refusing what it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI

from palaestra.orchestrator.cluster import Box, Cluster
from palaestra.orchestrator.supervisor import Fault, Supervisor, fault_kind
from palaestra.trainer.weight_sync import WeightSync
from tests.support.servers import ThreadServer


def _router(workers: dict[str, str], calls: list[str]) -> FastAPI:
    """TEST DOUBLE of sglang-router's `/workers` (list, add by URL, delete by id), over `workers`
    (id -> url)."""
    app = FastAPI()

    @app.get("/workers")
    async def listed() -> dict:
        return {"workers": [{"id": i, "url": u} for i, u in workers.items()]}

    @app.post("/workers", status_code=202)
    async def add(body: dict) -> dict:
        calls.append(f"add {body['url']}")
        workers[f"id-{len(workers)}"] = body["url"]
        return {"status": "accepted"}

    @app.delete("/workers/{worker}", status_code=202)
    async def delete(worker: str) -> dict:
        calls.append(f"delete {workers.pop(worker)}")
        return {"status": "accepted"}

    return app


def test_the_router_is_left_with_exactly_the_live_engines():
    from palaestra.config import load_config

    workers = {"w0": "http://n0:1", "w1": "http://n1:2/"}
    calls: list[str] = []
    with ThreadServer(_router(workers, calls)) as router:
        cluster = Cluster(load_config(None, []))
        cluster.router = Box("router", None, url=router.url)
        cluster.engines = [Box("engine-0", None, url="http://n0:1")]  # engine-1's node died
        cluster.sync_router()
        assert calls == ["delete http://n1:2/"]
        cluster.engines.append(Box("engine-1", None, url="http://n2:3"))  # started again elsewhere
        cluster.sync_router()
        cluster.sync_router()  # nothing left to change
    assert calls == ["delete http://n1:2/", "add http://n2:3"]
    assert sorted(workers.values()) == ["http://n0:1", "http://n2:3"]


def test_the_trainers_weight_syncs_follow_the_engines_left_except_over_nccl():
    with WeightSync(["http://127.0.0.1:1/", "http://127.0.0.1:2"], mode="tensor") as sync:
        sync.set_engines(["http://127.0.0.1:2/"])
        assert sync.urls == ["http://127.0.0.1:2"]
    with WeightSync(["http://127.0.0.1:1"], mode="distributed") as sync:
        with pytest.raises(ValueError, match="sync.mode distributed cannot change its engines"):
            sync.set_engines([])


def test_an_engines_node_has_a_fault_kind_and_counter_of_its_own():
    assert [
        fault_kind(c) for c in ("node of engine-1", "host of engine-0", "engine-1", "environment runner")
    ] == [
        "engine_node",
        "engine_host",
        "engine",
        "environment_runner",
    ]
    supervisor = Supervisor(cluster=None, max_restarts=1)
    supervisor.faults = [
        Fault("node of engine-1", "t", "the step's start", "node died", "started again", 6.3)
    ]
    assert supervisor.new_counters() == {
        "faults/total": 1.0,
        "faults/engine_node": 1.0,
        "faults/engine_node_recovery_s": 6.3,
    }


def test_the_drivers_halt_hook_names_what_it_cannot_read(tmp_path: Path):
    from palaestra.train import _halt_hook

    assert _halt_hook(None, tmp_path) is None
    for bad in ("batch", "lunch:1", "checkpoint:x"):
        with pytest.raises(
            SystemExit, match=r"PALAESTRA_TEST_HALT_AT=.*expected <phase>:<step> with a phase of batch"
        ):
            _halt_hook(bad, tmp_path)
    hook = _halt_hook("checkpoint:1", tmp_path)
    hook("checkpoint", 0, None)  # another moment: the run goes on
    hook("batch", 1, None)
    assert not (tmp_path / "halted").exists()
