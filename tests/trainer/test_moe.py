"""Mixture-of-experts models in the trainer: HF <-> Megatron conversion for both routing layouts.

Qwen3-MoE (softmax router, top-k renormalised) and GLM-4-MoE (sigmoid scores chosen with an expert
bias, a shared expert, a dense first layer, half-rotary RoPE): the conversion round trip is exact
under the checkpoint's HF names, and the Megatron model's logprobs on a packed batch equal the HF
model's. The models are tiny random ones (tests/trainer/moe_models.py), one process, gloo.
"""

from __future__ import annotations

import random

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
    from palaestra.engine.weights import read_safetensors

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
        after = trainer.logprobs([mb])[0]
    finally:
        bias.copy_(saved)
    assert name == "decoder.layers.1.mlp.router.expert_bias" and saved.abs().max() > 0.05
    assert (after - before).abs().max() > 1e-3
    assert torch.equal(trainer.logprobs([mb])[0], before)


def test_sigmoid_routing_without_renormalisation_is_refused():
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(**moe_models.COMMON | {"norm_topk_prob": False}, n_routed_experts=4,
                        architectures=["Glm4MoeForCausalLM"])  # fmt: skip
    with pytest.raises(ValueError, match="norm_topk_prob"):
        HFArchitecture.from_hf_config(cfg)
