"""Expert parallelism for real: two gloo processes with EP = 2 (and DP = 2) vs one process.

The two-rank harness of test_parallel.py runs on a tiny Qwen3-MoE model (tests/trainer/moe_models.py):
each rank holds two of the four experts of every layer and tokens travel to their experts through
Megatron's all-to-all dispatcher over gloo. One optimizer step must give the same logprobs, weights
(gathered back under whole-model names) and metrics as a single process on the whole batch. The
parallel layouts that do not divide the model are refused before any process group starts.
"""

from __future__ import annotations

import pytest

from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.convert import HFArchitecture
from palaestra.trainer.moe import check_layout
from palaestra.trainer.packing import build_micro_batch
from tests.trainer import moe_models
from tests.trainer.test_parallel import WORKER, compare, run_two_ranks


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    moe_models.build("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def single(moe_dir):
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    t = Trainer(TrainerConfig(**namespace["CONFIG"]), moe_dir)
    samples = namespace["samples"]()
    start = {k: v.clone() for k, v in t.megatron_state().items()}
    logprobs = t.logprobs([build_micro_batch(samples, range(len(samples)))])[0]
    metrics = t.step(samples)
    return {"start": start, "logprobs": logprobs, "metrics": metrics, "weights": t.megatron_state()}


@pytest.mark.slow
def test_two_expert_parallel_ranks_match_one_process(tmp_path, single, moe_dir):
    ranks, result = run_two_ranks(tmp_path, {"expert_model_parallel_size": 2}, moe_dir)
    assert all(r["load_exact"] for r in ranks)  # HF -> EP shard -> gather -> HF is bit-exact
    assert set(result["weights"]) == set(single["weights"])  # all four experts, whole-model names
    assert all(r["microbatches"] >= 1 for r in ranks)  # EP ranks are DP ranks: each trains its share
    compare(ranks, result, single, "EP=2 (DP=2)")
    imbalance = [r["metrics"]["train/moe_load_imbalance"] for r in ranks]
    assert imbalance[0] == pytest.approx(single["metrics"]["train/moe_load_imbalance"])
    assert imbalance[0] == imbalance[1] and imbalance[0] >= 1.0
    # each EP rank's experts have moments of their own: one optimizer file per EP rank, and a
    # resume at another EP size is refused rather than loading half the moments
    assert {p.name for p in (tmp_path / "ckpt").glob("optimizer_*")} == {
        "optimizer_tp0_ep0.pt",
        "optimizer_tp0_ep1.pt",
    }
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    with pytest.raises(ValueError, match="expert_model_parallel_size 2, this trainer has 1"):
        Trainer(TrainerConfig(**namespace["CONFIG"]), moe_dir).load(tmp_path / "ckpt")


def test_router_metrics_are_logged(single):
    m = single["metrics"]
    assert 1.0 <= m["train/moe_load_imbalance"] <= 4.0
    assert 0.25 <= m["train/moe_expert_share_max"] <= 1.0


def test_layouts_that_do_not_divide_the_model_are_refused(moe_dir):
    from transformers import AutoConfig

    arch = HFArchitecture.from_hf_config(
        AutoConfig.from_pretrained(moe_dir)
    )  # 4 experts, 2 layers, 4/2 heads
    with pytest.raises(ValueError, match="4 experts do not divide over expert_model_parallel_size 3"):
        check_layout(arch, {"expert_model_parallel_size": 3})
    with pytest.raises(ValueError, match="2 layers do not divide over pipeline_model_parallel_size 4"):
        check_layout(arch, {"pipeline_model_parallel_size": 4})
    with pytest.raises(
        ValueError, match="4 attention heads / 2 KV heads do not divide over tensor_model_parallel_size 4"
    ):
        check_layout(arch, {"tensor_model_parallel_size": 4})
    check_layout(arch, {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    with pytest.raises(
        ValueError, match="tensor_model_parallel_size 2 on a mixture-of-experts model: .*sequence_parallel"
    ):
        check_layout(arch, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2})
    dense = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(moe_dir)).__class__
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_layout(
            dense(**{**arch.__dict__, "num_experts": 0, "moe_layers": ()}), {"expert_model_parallel_size": 2}
        )
    with pytest.raises(ValueError, match="experts do not divide"):  # before any process group starts
        Trainer(TrainerConfig(megatron={"expert_model_parallel_size": 3}), moe_dir)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm_moe")
    moe_models.build("glm_moe", path, layers=4)
    return path


@pytest.mark.slow
def test_two_pipeline_stages_replay_the_rollout_routing_like_one_process(tmp_path, glm_dir):
    """PP = 2 on a 4-layer GLM-MoE with routing_replay r3: stage 0 holds the embedding, the dense
    layer and MoE layer 1, stage 1 MoE layers 2-3, the final norm and the head; Megatron's 1F1B
    schedule passes activations over gloo and each stage replays its own layers' rows of every
    sample's routed experts. The step equals one process's on the same routing, which differs from
    the step the routers would take choosing for themselves (a stage ignoring the routing fails)."""
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    steps = {}
    for replay in ("off", "r3"):
        t = Trainer(TrainerConfig(**namespace["CONFIG"], routing_replay=replay), glm_dir)
        batch = namespace["samples"](t.arch)
        steps[replay] = {
            "start": {k: v.clone() for k, v in t.megatron_state().items()},
            "logprobs": t.logprobs([build_micro_batch(batch, range(len(batch)))])[0],
        }
        steps[replay]["metrics"] = t.step(batch)
        steps[replay]["weights"] = t.megatron_state()
    assert abs(steps["r3"]["metrics"]["train/kl"] - steps["off"]["metrics"]["train/kl"]) > 1e-3
    ranks, result = run_two_ranks(
        tmp_path, {"pipeline_model_parallel_size": 2}, glm_dir, {"routing_replay": "r3"}
    )
    assert all(r["load_exact"] for r in ranks)  # HF -> stages -> gather -> HF is bit-exact
    assert ranks[0]["microbatches"] == ranks[1]["microbatches"]  # stages share the data
    compare(ranks, result, steps["r3"], "PP=2, r3")
    assert {p.name for p in (tmp_path / "ckpt").glob("optimizer_*")} == {
        "optimizer_tp0_pp0.pt",
        "optimizer_tp0_pp1.pt",
    }


def test_routing_replay_with_recompute_under_pipeline_parallelism_is_refused(glm_dir):
    with pytest.raises(ValueError, match="moe_layer_recompute is not supported"):
        Trainer(
            TrainerConfig(
                routing_replay="r2",
                megatron={"pipeline_model_parallel_size": 2, "moe_layer_recompute": True},
            ),
            glm_dir,
        )


def test_pipeline_with_tied_embeddings_is_refused_on_cpu(tiny_model_dir):
    with pytest.raises(ValueError, match="tied embeddings needs CUDA"):
        Trainer(TrainerConfig(megatron={"pipeline_model_parallel_size": 2}), tiny_model_dir)
