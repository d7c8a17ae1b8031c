"""The pieces that let a run outlive an engine's node, without Ray (issue 37; the Ray run that removes
nodes is tests/orchestrator/test_multinode.py): the router told which engines are left, the trainer's
weight syncs following them, the fault counted under its own kind, and the driver's halt test hook
refusing what it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI

from palaestra.config import LoggingOptions
from palaestra.orchestrator.checkpoint import RunState
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


class _Placing(Cluster):
    """A Cluster whose Ray is a list of where each engine's bundle lies now (None: on no live node)
    and whose engine start records its place: the placement logic of `rejoin_engines`, without Ray."""

    def __init__(self, placed: dict[str, str | None]):
        from palaestra.config import load_config

        super().__init__(load_config(None, []))
        self.placed, self.started = placed, []

    def _placed_node(self, options: dict) -> str | None:
        return self.placed[options["name"]]

    def _start_again(self, box: Box, node: str, index: int) -> str:
        self.started.append((box.name, node, index))
        self.engines.insert(index, Box(box.name, None, url=f"http://{node}:1", node=node))
        return f"started again on node {node}"


def test_an_engine_left_out_for_want_of_room_rejoins_once_a_node_with_room_joins():
    cluster = _Placing({"engine-0": None, "engine-2": None})
    cluster.engines = [Box("engine-1", None, url="http://n1:1", node="n1")]
    cluster.left_out = [Box(f"engine-{i}", None, options={"name": f"engine-{i}"}) for i in (2, 0)]
    supervisor = Supervisor(cluster, max_restarts=3)
    supervisor.faults = [
        Fault(f"node of engine-{i}", "t", "training", "node died", "no live node has room for it", 1.0)
        for i in (0, 2)
    ]
    assert supervisor.rejoin_engines("the step's start") == []  # no node joined yet: nothing asked twice
    assert cluster.started == [] and len(cluster.left_out) == 2
    cluster.placed["engine-0"] = "n9"  # a node with room for one engine joined: Ray put engine-0 there
    assert supervisor.rejoin_engines("the step's start") == ["engine-0"]
    assert cluster.started == [("engine-0", "n9", 0)]  # first again, before engine-1
    assert [b.name for b in cluster.engines] == ["engine-0", "engine-1"]
    assert [b.name for b in cluster.left_out] == ["engine-2"]
    zero, two = supervisor.faults
    assert "a node with room had joined: started again on node n9" in zero.action
    assert two.action == "no live node has room for it"
    cluster.placed["engine-2"] = "n8"
    assert supervisor.rejoin_engines("the step's start") == ["engine-2"]
    assert [b.name for b in cluster.engines] == ["engine-0", "engine-1", "engine-2"] and not cluster.left_out
    assert supervisor.new_counters()["faults/total"] == 2.0  # a rejoin is no death


def test_a_resumed_launch_keeps_the_earlier_launches_faults_in_faults_json(tmp_path: Path):
    """Launch A has a fault and is killed -9 after the step's row: faults.json has it, marked A (it
    is written as faults happen, not only at the run's end). Launch B, resumed, has one of its own:
    faults.json then lists A's and B's, each marked by its launch; a file of before has ``earlier``."""
    import json

    from palaestra.config import load_config
    from palaestra.orchestrator.loop import Run
    from palaestra.orchestrator.metrics import make_tracker
    from palaestra.orchestrator.supervisor import earlier_faults

    def launch(name: str) -> Run:  # the real `Run.log`, on a Run built without a cluster
        run = Run.__new__(Run)
        run.cfg = load_config(None, ["run.steps=4"])
        run.out, run.state, run._bar, run._held_row = tmp_path, RunState(), None, None
        run.tracker = make_tracker(LoggingOptions(), tmp_path, run_name="t", config={})
        run.supervisor = Supervisor(cluster=None, max_restarts=3, launch=name)
        run.earlier_faults = earlier_faults(tmp_path / "faults.json")
        return run

    a = launch("A")
    a.supervisor._noticed("engine-0", "generation", "exited with code -9")
    a.log(0, {"rollout/reward_mean": 0.5})  # then A is killed: no report, no end
    saved = json.loads((tmp_path / "faults.json").read_text())
    assert [(f["component"], f["launch"]) for f in saved] == [("engine-0", "A")]
    b = launch("B")
    b.log(1, {"rollout/reward_mean": 0.5})  # no fault of its own yet: the file is left as it was
    assert json.loads((tmp_path / "faults.json").read_text()) == saved
    b.supervisor._noticed("gateway", "training", "exited with code -9")
    b.log(2, {"rollout/reward_mean": 0.5})
    saved = json.loads((tmp_path / "faults.json").read_text())
    assert [(f["component"], f["launch"]) for f in saved] == [("engine-0", "A"), ("gateway", "B")]
    (tmp_path / "faults.json").write_text(json.dumps([{"component": "trainer"}]))  # unmarked
    assert earlier_faults(tmp_path / "faults.json") == [{"component": "trainer", "launch": "earlier"}]
    assert earlier_faults(tmp_path / "none.json") == []


def test_a_dead_trainer_ranks_shared_memory_weights_are_removed_when_the_trainer_is_rebuilt(tmp_path: Path):
    """A trainer rank killed -9 runs no finalizer: its /dev/shm/palaestra-weights-<pid>-* stays.
    `Cluster.replace_trainer` removes the folders of the ranks it replaced (here under
    trainer.sync.dir), and nothing of a live process or of a pid it was not told about."""
    import os

    from palaestra.config import load_config

    cluster = Cluster(load_config(None, [f"trainer.sync.dir={tmp_path}"]))
    dead, alive, other = 999999999, os.getpid(), 999999998  # above any pid_max: no such processes
    for pid, tag in ((dead, "aa"), (dead, "bb"), (alive, "cc"), (other, "dd")):
        (tmp_path / f"palaestra-weights-{pid}-{tag}").mkdir()
        (tmp_path / f"palaestra-weights-{pid}-{tag}" / "model.safetensors").write_bytes(b"x")
    removed = cluster.remove_trainer_files([dead, alive])
    assert [p.name for p in removed] == [f"palaestra-weights-{dead}-aa", f"palaestra-weights-{dead}-bb"]
    assert {p.name for p in tmp_path.iterdir()} == {
        f"palaestra-weights-{alive}-cc",
        f"palaestra-weights-{other}-dd",
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


def test_train_supervise_relaunches_a_crashed_driver_with_resume_at_most_n_times():
    """`palaestra train --supervise N`: a driver killed (-9) or failed (exit 1) is launched again
    with --resume; success or a config error (exit 2) ends at once; N relaunches at most."""
    from palaestra.train import supervise

    def launches(codes: list[int], times: int, argv: list[str]) -> tuple[int, list[list[str]]]:
        seen: list[list[str]] = []

        def launch(cmd: list[str]) -> int:
            seen.append(cmd[cmd.index("train") + 1 :])
            return codes[len(seen) - 1]

        return supervise(argv, times, launch), seen

    assert launches([-9, 1, 0], 3, ["c.yaml", "run.steps=4"]) == (
        0,
        [
            ["c.yaml", "run.steps=4"],
            ["c.yaml", "run.steps=4", "--resume"],
            ["c.yaml", "run.steps=4", "--resume"],
        ],
    )
    assert launches([-9, -9, -9], 2, ["c.yaml"]) == (
        -9,
        [["c.yaml"], ["c.yaml", "--resume"], ["c.yaml", "--resume"]],
    )
    assert launches([2], 3, ["bad.yaml"]) == (2, [["bad.yaml"]])
    assert launches([0], 3, ["c.yaml", "--resume"]) == (0, [["c.yaml", "--resume"]])
    assert launches([-9], 0, ["c.yaml"]) == (-9, [["c.yaml"]])  # --supervise 0: no relaunch


def test_train_supervise_refuses_a_negative_count():
    import argparse

    from palaestra.train import _non_negative

    assert _non_negative("3") == 3
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number >= 0 of relaunches"):
            _non_negative(bad)


def test_a_router_restarted_after_an_engine_left_starts_with_and_waits_for_the_engines_live_now(monkeypatch):
    """The chaos soak's node kind found it: a router killed after engine-1's node died restarted with
    its first worker list and waited for both workers to be healthy, so its restart timed out (the
    dead URL never answers) and the run failed. It now restarts with the engines live now."""
    import httpx

    from palaestra.config import load_config
    from palaestra.engine.router import RouterProcess
    from palaestra.net import ServerProcess

    started: list[list[str]] = []
    monkeypatch.setattr(ServerProcess, "restart", lambda self, extra=(): started.append(list(extra)) or self)
    router = RouterProcess(["http://n0:1", "http://n1:2"])
    cluster = Cluster(load_config(None, []))
    cluster.router, cluster.router_urls = (
        Box("router", None, url="http://r:9"),
        ["http://n0:1", "http://n1:2"],
    )
    cluster.engines = [Box("engine-0", None, url="http://n0:1")]  # engine-1's node died: left out
    args = cluster.restart_args(cluster.router)
    assert args == ["--worker-urls", "http://n0:1"]
    router.restart(args)
    assert started == [args] and router.worker_urls == ["http://n0:1"]
    ready = httpx.Response(200, json={"status": "ready", "healthy_workers": 1, "total_workers": 1})
    assert router._all_workers_healthy(ready)  # before: it waited for 2 healthy workers
    cluster.engines.append(Box("engine-1", None, url="http://n1:2"))
    assert cluster.restart_args(cluster.router) == []  # the engines it started with: its own command


def test_an_engine_rejoining_while_the_router_is_dead_leaves_the_router_to_its_restart():
    """The chaos soak (seed 1) found it: engine-1 rejoined at a step's start just after the router
    was killed, and telling the dead router its workers raised ConnectError, which ended the run.
    An unreachable router is left to the liveness check, whose restart lists the engines live then
    (engine-1 included). The router is a closed loopback port (no server, no Ray)."""
    from palaestra.config import load_config
    from palaestra.net import free_port

    cluster = Cluster(load_config(None, []))
    cluster.router = Box("router", None, url=f"http://127.0.0.1:{free_port()}")
    cluster.router_urls = ["http://n0:1", "http://n1:2"]
    cluster.engines = [Box("engine-0", None, url="http://n0:1"), Box("engine-1", None, url="http://n1:3")]
    cluster.sync_router()  # before: httpx.ConnectError
    assert cluster.restart_args(cluster.router) == ["--worker-urls", "http://n0:1", "http://n1:3"]


def test_a_trainer_rank_dying_while_a_rejoin_tells_it_the_engines_is_rebuilt_not_the_end():
    """The chaos soak (seed 1) found it: a trainer rank killed while engine-1 rejoined made telling
    the trainer the engines fail, and that ended the run. The rank's death is now the trainer's
    fault (`Replaced`): it is rebuilt, with the engines live then (engine-1 among them). The
    cluster is a TEST DOUBLE (`_Placing`) whose trainer call raises what Ray raises for a dead actor."""
    import ray

    from palaestra.orchestrator.errors import Replaced

    class _RankDies(_Placing):
        def _start_again(self, box: Box, node: str, index: int) -> str:
            super()._start_again(box, node, index)
            raise ray.exceptions.RayActorError()  # what `_tell_trainer_engines` lets through

    cluster = _RankDies({"engine-1": "n9"})
    cluster.engines = [Box("engine-0", None, url="http://n0:1", node="n0")]
    cluster.left_out = [Box("engine-1", None, options={"name": "engine-1"})]
    supervisor = Supervisor(cluster, max_restarts=3)
    with pytest.raises(Replaced) as raised:
        supervisor.rejoin_engines("the step's start")  # before: RunFailed("telling the trainer failed: ...")
    assert raised.value.component == "trainer"
    assert [b.name for b in cluster.engines] == ["engine-0", "engine-1"] and not cluster.left_out


def test_a_trainer_rank_dying_while_told_an_engine_was_left_out_is_rebuilt_not_the_end(monkeypatch):
    """The same death when no node has room for the dead engine: `Cluster.replace_engine` tells the
    trainer as a rejoin does (`_tell_trainer_engines`), the engine stays left out (to rejoin later),
    and the supervisor hands the rank's death to `actor_died`. Ray is monkeypatched: `ray.get`
    raises what it raises for a dead actor, `ray.kill` has nothing to kill."""
    import ray

    from palaestra.config import load_config
    from palaestra.orchestrator.errors import Replaced

    class _NoRoom(Cluster):
        def node_alive(self, node: str) -> bool:
            return False

        def _bundle_node(self, options: dict, wait_s: float) -> None:
            return None

        def sync_router(self) -> None:
            pass

        def trainer_call(self, method: str, *args, rank0_args=None) -> list:
            self.told.append(args[0])
            return ["a call to a dead rank"]

    def dead_rank(refs, **kwargs):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(ray, "get", dead_rank)
    cluster = _NoRoom(load_config(None, []))
    cluster.told = []
    dead = Box("engine-1", None, url="http://n1:1", node="n1")
    cluster.engines = [Box("engine-0", None, url="http://n0:1", node="n0"), dead]
    supervisor = Supervisor(cluster, max_restarts=3)
    with pytest.raises(Replaced) as raised:  # before: RunFailed("telling the trainer failed: ...")
        supervisor._replace_engine(dead, "training", RuntimeError("node n1 died"))
    assert raised.value.component == "trainer"
    assert cluster.told == [["http://n0:1"]]
    assert [b.name for b in cluster.engines] == ["engine-0"] and cluster.left_out == [dead]
    engine, trainer = supervisor.faults
    assert engine.component == "node of engine-1" and "the engines live then: engine-0" in engine.action
    assert trainer.component == "trainer"
