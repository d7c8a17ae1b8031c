"""Mixture-of-experts models in the trainer: HF <-> Megatron conversion for both routing layouts.

Qwen3-MoE (softmax router, top-k renormalised) and GLM-4-MoE (sigmoid scores chosen with an expert
bias, a shared expert, a dense first layer, half-rotary RoPE): the conversion round trip is exact
under the checkpoint's HF names, and the Megatron model's logprobs on a packed batch equal the HF
model's. The models are tiny random ones (tests/trainer/moe_models.py), one process, gloo.
"""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.convert import HFArchitecture, hf_to_megatron, megatron_to_hf
from palaestra.trainer.packing import build_micro_batch
from tests.trainer import moe_models

KINDS = ("qwen3_moe", "glm_moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF directory, HF model, Trainer on it)."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = moe_models.build(kind, path)
        out[kind] = (path, hf, Trainer(TrainerConfig(megatron_optimizer={"lr": 1e-3}), path))
    return out


def samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    result = []
    for i in range(n):
        prompt = [rng.randrange(3, moe_models.VOCAB) for _ in range(rng.randint(3, 12))]
        resp = [rng.randrange(3, moe_models.VOCAB) for _ in range(rng.randint(4, 30))]
        s = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(i % 4 == 0))  # fmt: skip
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        result.append(s)
    return result


def hf_logprobs(hf, s: Sample) -> torch.Tensor:
    """log p(token) of each response token, one sequence at a time (no packing)."""
    ids = torch.tensor([s.tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, s.prompt_len - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[0, s.prompt_len :, None])[:, 0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_round_trip_is_exact_under_checkpoint_names(models, kind):
    from palaestra.weights_format import read_safetensors

    path, hf, trainer = models[kind]
    disk = dict(read_safetensors(path))
    arch = HFArchitecture.from_hf_config(hf.config)
    assert arch.is_moe and arch.num_experts == 4 and arch.moe_topk == 2
    back = megatron_to_hf(hf_to_megatron(disk, arch), arch)
    assert set(back) == set(disk)
    assert all(torch.equal(back[k], disk[k]) for k in disk)
    # what weight sync sends: the live model under the same names, per expert
    live = trainer.hf_state()
    assert set(live) == set(disk) and all(torch.equal(live[k], disk[k]) for k in disk)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in live


def test_layouts_reach_megatron_as_their_router_options(models):
    q = models["qwen3_moe"][2].transformer_config
    assert (q.num_moe_experts, q.moe_router_topk, q.moe_ffn_hidden_size) == (4, 2, 32)
    assert q.moe_router_score_function == "softmax" and not q.moe_router_pre_softmax
    assert q.moe_layer_freq == [1, 1] and not q.moe_grouped_gemm
    g = models["glm_moe"][2].transformer_config
    assert g.moe_router_score_function == "sigmoid" and g.moe_router_enable_expert_bias
    assert g.moe_layer_freq == [0, 1] and g.moe_shared_expert_intermediate_size == 32
    assert g.moe_router_topk_scaling_factor == 2.5 and g.moe_router_bias_update_rate == 0.0
    layers = models["glm_moe"][2].gpt.decoder.layers
    assert not hasattr(layers[0].mlp, "router") and hasattr(layers[1].mlp, "shared_experts")


@pytest.mark.parametrize("kind", KINDS)
def test_packed_logprobs_match_hf(models, kind):
    path, hf, trainer = models[kind]
    batch = samples(6)
    got = build_micro_batch(batch, range(len(batch))).per_sample(
        trainer.logprobs([build_micro_batch(batch, range(len(batch)))])[0]
    )
    diff = max((g - hf_logprobs(hf, s)).abs().max().item() for g, s in zip(got, batch, strict=True))
    spread = torch.cat(got).std().item()
    print(f"\n{kind}: max |logprob(Megatron) - logprob(HF)| = {diff:.2e} (logprob spread {spread:.2f})")
    assert spread > 0.5  # far from uniform: a wrong expert or router would show
    assert diff <= 2e-5


def test_expert_bias_takes_part_in_the_choice(models):
    """GLM's e_score_correction_bias is loaded into the router: zeroing it changes the logprobs."""
    path, hf, trainer = models["glm_moe"]
    batch = samples(4, seed=3)
    mb = build_micro_batch(batch, range(len(batch)))
    before = trainer.logprobs([mb])[0]
    (name, bias), = trainer.routing_buffers()  # fmt: skip
    saved = bias.clone()
    try:
        bias.zero_()
        trainer.snapshots.mark_live_changed()  # the bias is part of the weights the snapshots guard
        after = trainer.logprobs([mb])[0]
    finally:
        bias.copy_(saved)
        trainer.snapshots.mark_live_changed()
    assert name == "decoder.layers.1.mlp.router.expert_bias" and saved.abs().max() > 0.05
    assert (after - before).abs().max() > 1e-3
    assert torch.equal(trainer.logprobs([mb])[0], before)


def test_sigmoid_routing_without_renormalisation_is_refused():
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(**moe_models.COMMON | {"norm_topk_prob": False}, n_routed_experts=4,
                        architectures=["Glm4MoeForCausalLM"])  # fmt: skip
    with pytest.raises(ValueError, match="norm_topk_prob"):
        HFArchitecture.from_hf_config(cfg)


# -- routing replay (trainer.routing_replay) ------------------------------------------------------
def random_routing(s: Sample, rows: int, layers: int = 2, experts: int = 4, k: int = 2, seed: int = 0):
    """`rows` tokens' worth of k distinct experts per MoE layer, chosen at random (int16)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows * layers)])
        .reshape(rows, layers, k)
        .to(torch.int16)
        .numpy()
    )


def hf_forced_logprobs(hf, s: Sample) -> torch.Tensor:
    """HF Qwen3-MoE logprobs with every router made to choose `s.routed_experts` (its weights: the
    softmax of the chosen experts' logits, what norm_topk_prob gives)."""
    routed = torch.as_tensor(s.routing()).long()
    n = len(s.tokens)
    if routed.shape[0] == n - 1:  # the last token's experts do not matter (causal)
        routed = torch.cat([routed, torch.arange(routed.shape[2]).expand(1, routed.shape[1], -1)])
    originals = []
    for layer_index, layer in enumerate(hf.model.layers):
        gate = layer.mlp.gate
        originals.append(gate.forward)

        def forced(hidden, gate=gate, ids=routed[:, layer_index]):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            return logits, torch.softmax(logits.gather(1, ids), -1), ids

        gate.forward = forced
    try:
        return hf_logprobs(hf, s)
    finally:
        for layer, original in zip(hf.model.layers, originals, strict=True):
            layer.mlp.gate.forward = original


@pytest.fixture(scope="module")
def r3_trainer(models):
    path = models["qwen3_moe"][0]
    return Trainer(
        TrainerConfig(routing_replay="r3", megatron_optimizer={"optimizer": "sgd", "lr": 0.1}), path
    )


def test_r3_logprobs_follow_the_rollout_routing(models, r3_trainer):
    """Routing unlike the model's own choice: replayed logprobs equal HF forced to that routing and
    differ from the model routing freely (a trainer that ignored routed_experts fails here)."""
    from palaestra.trainer import moe

    hf = models["qwen3_moe"][1]
    batch = samples(4, seed=5)
    for i, s in enumerate(batch):  # rows for all tokens, or all but the last (engines' usual)
        s.set_routing(random_routing(s, len(s.tokens) - (i % 2), seed=i))
    mb = build_micro_batch(batch, range(len(batch)))
    free = r3_trainer.logprobs([mb])[0]
    mb.routing = moe.rollout_routing(batch, mb.sample_indices, r3_trainer.arch)
    with r3_trainer.replay.active("replay"):
        replayed = r3_trainer.logprobs([mb])[0]
    want = torch.cat([hf_forced_logprobs(hf, s) for s in batch])
    diff = (replayed - want).abs().max().item()
    moved = (free - want).abs().max().item()
    print(f"\nr3: max |replayed - HF forced| = {diff:.2e}; free routing differs by up to {moved:.2f}")
    assert diff <= 2e-5
    assert moved > 0.1
    assert torch.equal(r3_trainer.logprobs([mb])[0], free)  # outside the replay the router chooses again


def test_r3_drops_samples_whose_routing_does_not_fit(models, r3_trainer):
    batch = samples(4, seed=6)
    for i, s in enumerate(batch):
        s.set_routing(random_routing(s, len(s.tokens), seed=i))
    batch[1].set_routing(batch[1].routing()[:, :1])  # one MoE layer short
    batch[2].routed_experts = None
    with pytest.warns(
        UserWarning, match=r"dropped 2 sample\(s\): sample s1: routed_experts has shape .*2 MoE layers"
    ):
        metrics = r3_trainer.step(batch)
    assert metrics["train/routing_replay_dropped"] == 2.0
    assert metrics["train/loss_tokens"] == float(batch[0].num_sampled + batch[3].num_sampled)
    with pytest.raises(ValueError, match="sample s2: no routed_experts"):
        r3_trainer.step([batch[2]])


def test_r3_takes_the_old_logprobs_from_the_update_as_its_own_pass_would_and_r2_cannot(models):
    """Under r3 the old pass and the update replay the same rollout routing, so the update's forward
    gives the old logprobs (Trainer.separate_old_pass, tests/trainer/test_old_pass.py): two steps
    match a trainer that runs the pass apart. r2 records the routing in that pass: it stays apart."""
    path = models["qwen3_moe"][0]
    config = TrainerConfig(routing_replay="r3", megatron_optimizer={"lr": 1e-2}, max_tokens_per_microbatch=64)
    fused, apart = Trainer(config, path), Trainer(config, path)
    apart.separate_old_pass = lambda k=0: "for comparison"
    batch = samples(6, seed=9)
    for i, s in enumerate(batch):
        s.set_routing(random_routing(s, len(s.tokens), seed=i))
    for _ in range(2):
        a, b = fused.step(batch), apart.step(batch)
        assert (a["perf/old_pass_fused"], b["perf/old_pass_fused"]) == (1.0, 0.0)
        for key in ("train/loss", "train/grad_norm", "train/ratio_mean", "mismatch/kl", "train/clipfrac"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), key
        wa, wb = fused.megatron_state(), apart.megatron_state()
        assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)
    assert a["train/grad_norm"] > 0 and a["perf/microbatches"] > 1
    r2 = Trainer(TrainerConfig(routing_replay="r2"), path)
    assert "routing_replay r2" in r2.separate_old_pass()


def test_r3_takes_the_engines_layout_with_a_row_for_every_layer(models):
    """GLM: one dense layer, then one MoE layer. The engine reports both (the dense one filler);
    the trainer keeps the MoE layer's rows and refuses a third layer."""
    from palaestra.trainer import moe

    arch = models["glm_moe"][2].arch
    s = samples(1, seed=8)[0]
    moe_only = random_routing(s, len(s.tokens) - 1, layers=1)
    every = np.concatenate([np.zeros_like(moe_only), moe_only], axis=1)  # [T-1, 2 layers, 2]
    s.set_routing(every)
    assert moe.routing_problem(s, arch) is None
    (ids,) = moe.rollout_routing([s], [0], arch)
    assert torch.equal(ids[:-1], torch.as_tensor(moe_only[:, 0]).long())
    s.set_routing(np.concatenate([every, moe_only], axis=1))
    assert "1 MoE layers or all 2 layers" in moe.routing_problem(s, arch)


def test_r2_replays_the_old_policy_routing_in_the_update(models):
    from palaestra.trainer import moe

    path = models["qwen3_moe"][0]
    t = Trainer(
        TrainerConfig(routing_replay="r2", keep_old_actor=True, megatron_optimizer={"lr": 1e-2}), path
    )
    batch = samples(4, seed=7)
    t.step(batch)  # the old actor now differs from the live weights
    seen = []
    original = moe.RoutingReplay.before_forward

    def spy(self, mb):
        seen.append((self.mode, None if mb.routing is None else [r.clone() for r in mb.routing]))
        original(self, mb)

    moe.RoutingReplay.before_forward = spy
    try:
        metrics = t.step(batch)
    finally:
        moe.RoutingReplay.before_forward = original
    modes = [m for m, _ in seen]
    assert modes[0] == "record" and modes[-1] == "replay"  # old pass records, the update replays
    recorded = seen[-1][1]
    assert recorded is not None and len(recorded) == 2 and recorded[0].shape[1] == 2
    assert metrics["train/update_successful"] == 1.0


def test_routing_replay_needs_a_moe_model(tiny_model_dir):
    with pytest.raises(ValueError, match="routing_replay: r3 .* dense model"):
        Trainer(TrainerConfig(routing_replay="r3"), tiny_model_dir)
    with pytest.raises(ValueError, match="routing_replay must be"):
        TrainerConfig(routing_replay="r4")
    assert TrainerConfig(routing_replay=False).routing_replay == "off"  # YAML's reading of a bare off


def test_routed_experts_survive_the_sample_round_trip():
    import numpy as np

    s = samples(1)[0]
    routing = random_routing(s, len(s.tokens))
    s.set_routing(routing)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.routed_experts["dtype"] == "uint8" and np.array_equal(back.routing(), routing)


def test_opd_at_every_granularity_on_moe_under_r3(models, tmp_path):
    """A MoE student distilled from three MoE teachers (the GLM layout: sigmoid router, shared expert,
    dense first layer), one per granularity (sampled, top-k, full), with the student replaying the
    rollout's routing (r3) and each teacher routing for itself. Four steps move the student towards
    each teacher on its own environment: the exact top-k and full reverse KLs fall, the sampled
    teacher's signal enters the advantage."""
    from palaestra.trainer.config import OpdOptions

    path = models["glm_moe"][0]
    teachers = {}
    for name, seed in (("sampled", 1), ("topk", 2), ("full", 3)):
        hf = moe_models.build("glm_moe", tmp_path / name, seed=seed)
        del hf
        teachers[name] = str(tmp_path / name)
    cfg = TrainerConfig(
        advantage_estimator="none",
        routing_replay="r3",
        megatron_optimizer={"lr": 3e-3},
        opd=OpdOptions(
            kl_coef=1.0,
            teachers={
                g: {"mode": "megatron", "model": teachers[g], "granularity": g, "topk": 16} for g in teachers
            },
        ),
    )
    t = Trainer(cfg, path)
    batch = []
    for k, env in enumerate(teachers):
        part = samples(4, seed=10 + k)
        for i, s in enumerate(part):
            s.sample_id = s.session_id = f"{env}{i}"
            s.env = env
            s.set_routing(random_routing(s, len(s.tokens) - 1, layers=2, seed=100 * k + i))
        batch += part
    metrics = [t.step(batch) for _ in range(4)]
    assert {s.teacher for s in batch} == set(teachers)
    assert all(m["train/routing_replay_dropped"] == 0.0 for m in metrics)
    for env in ("topk", "full"):
        rkl = [m[f"opd/{env}/reverse_kl"] for m in metrics]
        print(env, [round(x, 4) for x in rkl])
        assert all(b < a for a, b in itertools.pairwise(rkl)) and rkl[-1] < 0.9 * rkl[0], (env, rkl)
    sampled = [m for m in metrics[-1] if m.startswith("opd/sampled/")]
    assert sampled and all(np.isfinite(metrics[-1][k]) for k in sampled), sampled
