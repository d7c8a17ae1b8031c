"""Several Ray nodes on one machine (`ray.cluster_utils.Cluster`, every node on 127.0.0.1): the
engines on one node, the two data-parallel trainer ranks on two others, placed by custom resources.

1. Trainer level: two thin test actors around the real `Trainer` rendezvous at rank 0's node
   (gloo), train on the batch split between them, and rank 0 pushes every step's weights to both
   real engines over SGLang's broadcast path (`sync.mode: distributed`, the sync that needs
   nothing shared between nodes). Checked: where every actor ran, that both engines end at the
   trainer's weight version, and that their logprobs then equal the trainer's.
2. The driver: `palaestra train` joins the cluster (`run.ray_address`), `run.resources` puts the
   engines on the engine node and one trainer rank on each trainer node (`trainer.dp_size: 2`,
   decoupled), and the printed placement shows it.
3. A node that dies with an engine on it (issue 37): three one-engine nodes added to the cluster,
   two engines on two of them; the hook removes engine-1's node when step 1 is over (Ray places
   its bundle on the spare node: the engine starts there with the current weights) and engine-0's
   node when step 2 is over (no node has room: the run goes on with one engine). The run finishes
   every step, each spooled sample trained once or recorded with a reason, each death reported.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.engine]

ENGINE_NODE, TRAINER_NODE = "palaestra_test_engine_node", "palaestra_test_trainer_node"
LOST_NODE = "palaestra_test_lost_node"  # the nodes test 3 removes (room for one engine each)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # node addresses of 127.0.0.1 taken literally ("single-node Ray"; several raylets still work)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the variable was set

    if ray.is_initialized():  # the local Ray the other modules share (conftest.py's `ray_local`)
        ray.shutdown()  # this test needs a cluster of its own; the next module starts that one again
    saved = os.environ.get("PYTHONPATH")  # the nodes' workers import tests.orchestrator.test_multinode
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(Path(__file__).resolve().parents[2]), saved] if p
    )
    # workers at nice 0, not Ray's 15: beside other tests in parallel they would get almost no CPU
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        # every node on loopback: the nodes are separate raylets, and nothing listens beyond 127.0.0.1
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 3, "resources": {ENGINE_NODE: 2}, "include_dashboard": False,
                            "node_ip_address": "127.0.0.1"},
        )  # fmt: skip
        for _ in range(2):
            c.add_node(num_cpus=1, resources={TRAINER_NODE: 1}, node_ip_address="127.0.0.1")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    ray.init(address=c.address, logging_level="WARNING")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class EngineHost:
    """An embedded engine subprocess on this actor's node, bound to the node's address."""

    def __init__(self) -> None:
        import ray

        from palaestra.engine.cli import engine_process

        self.node = ray.get_runtime_context().get_node_id()
        self.proc = engine_process(
            "tiny", host=ray.util.get_node_ip_address(), extra_args=["--num-threads", "1"]
        )
        self.proc.start()

    def where(self) -> tuple[str, str]:
        return self.node, self.proc.url

    def stop(self) -> None:
        self.proc.stop()


class TrainerRank:
    """One rank of the Megatron trainer (RANK/WORLD_SIZE/MASTER_* set before it starts)."""

    def __init__(self, rank: int, world: int) -> None:
        import ray

        self.rank, self.world = rank, world
        self.node = ray.get_runtime_context().get_node_id()
        self.trainer = None

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        from palaestra.net import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def build(self, master: tuple[str, int], engine_urls: list[str]) -> str:
        import torch

        from palaestra.models import resolve_model
        from palaestra.trainer import Trainer, TrainerConfig
        from palaestra.trainer.config import SyncOptions

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))  # fmt: skip
        torch.set_num_threads(1)
        config = TrainerConfig(megatron_optimizer={"lr": 1e-2}, sync=SyncOptions(mode="distributed", bucket_mb=4),
                               dp_size=self.world)  # fmt: skip
        self.trainer = Trainer(config, resolve_model("tiny"), engine_urls=engine_urls)
        return self.node

    def step(self, samples: list) -> dict[str, float]:
        return self.trainer.step(samples if self.rank == 0 else [])

    def logprobs(self, samples: list) -> list[float]:
        from palaestra.trainer.packing import build_micro_batch

        return self.trainer.logprobs([build_micro_batch(samples, range(len(samples)))])[0].tolist()

    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()


def batch(n: int = 8) -> list:
    from palaestra.sample import Sample

    rng = random.Random(4)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 8))]
        s = Sample(sample_id=f"m{i}", session_id=f"m{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(i % 2))  # fmt: skip
        n_resp = rng.choice([6, 20, 40])
        s.append([rng.randrange(3, 4000) for _ in range(n_resp)], sampled=True, logprobs=[-8.3] * n_resp)
        out.append(s)
    return out


def test_engines_on_one_node_trainer_ranks_on_two_others(cluster):
    import ray

    engine_cls = ray.remote(EngineHost).options(num_cpus=0, resources={ENGINE_NODE: 1})
    rank_cls = ray.remote(TrainerRank).options(num_cpus=1, resources={TRAINER_NODE: 1})
    engines = [engine_cls.remote() for _ in range(2)]
    ranks = [rank_cls.remote(r, 2) for r in range(2)]
    try:
        check(engines, ranks)
    finally:
        ray.get([e.stop.remote() for e in engines])
        for actor in [*engines, *ranks]:  # frees their node resources for the next test
            ray.kill(actor)


def test_palaestra_train_across_nodes_with_two_data_parallel_ranks(cluster, tmp_path, caplog):
    """The driver itself: `run.ray_address` joins the cluster, `run.resources` puts the engines on
    the engine node and one trainer rank on each trainer node, weights reach both engines."""
    import logging

    from palaestra.train import train
    from tests.support.runs import make_config

    resources = f"run.resources={{trainer: {{{TRAINER_NODE}: 1}}, engines: {{{ENGINE_NODE}: 1}}}}"
    cfg = make_config(tmp_path / "run", "sync", f"run.ray_address={cluster.address}", "run.placement=decoupled",
                      "trainer.dp_size=2", "trainer.sync.mode=distributed", resources, "env.eval_tasks=0")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="palaestra.orchestrator.cluster"):
        result = train(cfg)
    assert result.engine_versions_end == ["2", "2"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("  ")]
    print("\n" + "\n".join(lines))
    node = lambda line: line.split("(node ")[1].split(")")[0]  # noqa: E731
    ranks = [node(line) for line in lines if line.startswith("  trainer rank")]
    engines = {node(line) for line in lines if line.startswith("  engine-")}
    assert len(ranks) == 2 and len(set(ranks)) == 2 and len(engines) == 1 and engines.isdisjoint(ranks)


def test_an_engine_whose_node_dies_starts_again_where_there_is_room_else_the_run_goes_on_without_it(
    cluster, tmp_path
):
    import ray

    from palaestra.orchestrator.audit import spooled
    from palaestra.train import train
    from tests.orchestrator.test_faults import _gone, _until
    from tests.support.runs import make_config

    nodes = [
        cluster.add_node(num_cpus=1, resources={LOST_NODE: 1}, node_ip_address="127.0.0.1") for _ in range(3)
    ]
    cluster.wait_for_nodes()
    removed: list[tuple[str, int]] = []  # (engine, step after which its node was removed)

    def hook(phase: str, step: int, run) -> None:
        if phase != "step" or step > 1:
            return
        (box,) = [b for b in run.cluster.engines if b.name == ("engine-1", "engine-0")[step]]
        pid = ray.get(box.actor.pid.remote(), timeout=60)
        cluster.remove_node(next(n for n in nodes if n.node_id == box.node))
        _until(lambda: _gone(pid), f"{box.name}'s engine (pid {pid}) to end with its node")
        removed.append((box.name, step))

    # the services (router, gateway, environment runner) on the head, which no test removes
    resources = (f"run.resources={{trainer: {{{TRAINER_NODE}: 1}}, engines: {{{LOST_NODE}: 1}}, "
                 f"services: {{{ENGINE_NODE}: 0.01}}}}")  # fmt: skip
    cfg = make_config(tmp_path / "run", "sync", f"run.ray_address={cluster.address}", "run.placement=decoupled",
                      resources, "run.steps=3", "run.checkpoint_every=3", "env.eval_tasks=0")  # fmt: skip
    try:
        result = train(cfg, hook=hook)
    finally:
        for node in nodes:
            if node.node_id in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
                cluster.remove_node(node)
    assert removed == [("engine-1", 0), ("engine-0", 1)]
    restarted, lost = result.faults
    print(f"\n{restarted['component']}: {restarted['action']} ({restarted['recovery_s']:.1f} s)"
          f"\n{lost['component']}: {lost['action']} ({lost['recovery_s']:.1f} s)")  # fmt: skip
    assert restarted["component"] == "node of engine-1" and restarted["phase"] == "the step's start"
    assert "started again on node" in restarted["action"] and "weight version 1 loaded" in restarted["action"]
    assert lost["component"] == "node of engine-0"
    assert "the run goes on with 1 engine(s) (engine-1)" in lost["action"]
    # every step once, the engine left at the last version, each sample trained once or not with a reason
    assert [r.step for r in result.trained] == [0, 1, 2] and result.engine_versions_end == ["3"]
    trained = [sid for r in result.trained for sid in r.sample_ids]
    assert len(trained) == len(set(trained))
    not_trained = result.not_trained or {}
    samples = {s["sample_id"] for s in spooled(result.output_dir)}
    assert samples == set(trained) | set(not_trained) and not set(trained) & set(not_trained)
    # reported: faults.json, the summary line, the faults/* counters
    out = result.output_dir
    assert json.loads((out / "faults.json").read_text()) == result.faults
    assert "node of engine-0" in result.summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("faults/engine_node", 0) for r in rows) == 2


def check(engines: list, ranks: list) -> None:
    import httpx
    import ray

    placed = ray.get([e.where.remote() for e in engines])
    urls = [url for _, url in placed]
    master = ray.get(ranks[0].rendezvous_address.remote())
    trainer_nodes = ray.get([r.build.remote(master, urls) for r in ranks], timeout=600)
    engine_nodes = {node for node, _ in placed}
    print(f"\nplacement: engines on {sorted(engine_nodes)}, trainer ranks on {trainer_nodes}; "
          f"rendezvous {master[0]}:{master[1]}; engines {urls}")  # fmt: skip
    assert len(engine_nodes) == 1 and len(set(trainer_nodes)) == 2
    assert engine_nodes.isdisjoint(trainer_nodes)
    assert ray.get([r.dp_size.remote() for r in ranks]) == [2, 2]

    samples = batch()
    with httpx.Client(timeout=60, trust_env=False) as client:

        def engine_logprobs(url: str) -> list[float]:
            got = []
            for s in samples:
                r = client.post(f"{url}/generate", json={"input_ids": s.tokens, "sampling_params": {"max_new_tokens": 0},
                                                         "return_logprob": True, "logprob_start_len": 0})  # fmt: skip
                got.extend(x[0] for x in r.json()["meta_info"]["input_token_logprobs"][s.prompt_len :])
            return got

        before = engine_logprobs(urls[0])
        for _ in range(2):
            metrics = ray.get([r.step.remote(samples) for r in ranks], timeout=600)
            assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"])
        versions = [client.get(f"{u}/model_info").json()["weight_version"] for u in urls]
        mine = ray.get(ranks[0].logprobs.remote(samples))
        theirs = [engine_logprobs(u) for u in urls]
    assert versions == ["2", "2"]
    assert max(abs(a - b) for a, b in zip(before, theirs[0], strict=True)) > 1e-3  # weights moved
    for got in theirs:  # and every engine holds exactly the trainer's
        assert max(abs(a - b) for a, b in zip(mine, got, strict=True)) <= 2e-6
