"""The Megatron model on CPU: conversion, logits vs HF, packing, snapshots, training, checkpoints.

Everything runs megatron-core 0.16.1 for real (gloo, world size 1, local layer spec) on the `tiny`
preset and on two small random Llama / Qwen3 models built here (untied head, GQA 4:1, QK-norm).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig, cpu_shim, format_metrics, losses
from palaestra.trainer.config import KlOptions, OpdOptions
from palaestra.trainer.convert import HFArchitecture, hf_to_megatron, megatron_to_hf
from palaestra.trainer.packing import build_micro_batch


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return Trainer(TrainerConfig(megatron_optimizer={"lr": 1e-3}), tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _small_hf(tmp_path, family: str):
    """A random 2-layer Llama (untied, GQA 4:1) or Qwen3 (QK-norm, head_dim != hidden/heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen3Config(**common, num_key_value_heads=2, head_dim=48, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / family
    model.save_pretrained(out)
    return out, model.eval()


def _samples(n: int, seed: int = 0, vocab: int = 4000) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        resp = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 30))]
        s = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(i % 4 == 0))  # fmt: skip
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


# -- conversion --------------------------------------------------------------------------------
def test_conversion_round_trip_is_bit_exact(hf_tiny, tmp_path):
    for hf, arch in [
        (hf_tiny, HFArchitecture.from_hf_config(hf_tiny.config)),
        *[
            (m, HFArchitecture.from_hf_config(m.config))
            for _, m in (_small_hf(tmp_path, f) for f in ("llama", "qwen3"))
        ],
    ]:
        hf_state = {
            k: v
            for k, v in hf.state_dict().items()
            if not (arch.tie_word_embeddings and k == "lm_head.weight")
        }
        mg = hf_to_megatron(hf_state, arch)
        back = megatron_to_hf(mg, arch)
        assert set(back) == set(hf_state)
        assert all(torch.equal(back[k], hf_state[k]) for k in back), arch.architecture
        again = hf_to_megatron(back, arch)
        assert all(torch.equal(again[k], mg[k]) for k in mg)


def test_fused_qkv_is_grouped_per_kv_head(hf_tiny):
    arch = HFArchitecture.from_hf_config(hf_tiny.config)  # 4 heads, 2 KV heads, head_dim 64
    d, state = arch.head_dim, dict(hf_tiny.state_dict())
    qkv = hf_to_megatron(state, arch)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    # group 0: q heads 0, 1, then k head 0, then v head 0; group 1: q heads 2, 3, k 1, v 1
    want = torch.cat([q[: 2 * d], k[:d], v[:d], q[2 * d :], k[d:], v[d:]])
    assert torch.equal(qkv, want)
    bias = hf_to_megatron(state, arch)["decoder.layers.0.self_attention.linear_qkv.bias"]
    qb, kb, vb = (state[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
    assert torch.equal(bias, torch.cat([qb[: 2 * d], kb[:d], vb[:d], qb[2 * d :], kb[d:], vb[d:]]))


def test_unknown_or_missing_tensors_raise(hf_tiny):
    arch = HFArchitecture.from_hf_config(hf_tiny.config)
    state = dict(hf_tiny.state_dict())
    with pytest.raises(KeyError, match="unexpected HF tensors"):
        hf_to_megatron({**state, "model.extra.weight": torch.zeros(1)}, arch)
    state.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_megatron(state, arch)


# -- logits ---------------------------------------------------------------------------------
def _megatron_logits(trainer: Trainer, ids: torch.Tensor) -> torch.Tensor:
    from palaestra.trainer.megatron_model import quiet_megatron_deprecations

    trainer.model.eval()
    with torch.no_grad(), quiet_megatron_deprecations():
        return trainer.gpt(ids, torch.arange(ids.shape[1])[None], None)


def test_megatron_logits_match_hf(trainer, hf_tiny, tmp_path):
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_tiny(ids).logits
    got = _megatron_logits(trainer, ids)
    print(f"\ntiny (Qwen2): max |logit diff| = {(got - want).abs().max().item():.2e}")
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for family in ("llama", "qwen3"):
        path, hf = _small_hf(tmp_path, family)
        t = Trainer(TrainerConfig(), path)
        ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = hf(ids).logits
        got = _megatron_logits(t, ids)
        print(
            f"{family}: max |logit diff| = {(got - want).abs().max().item():.2e} (logit scale {want.abs().max():.1f})"
        )
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_architecture_fields_cannot_be_overridden(tiny_model_dir):
    with pytest.raises(ValueError, match="contradicts the HF config"):
        Trainer(TrainerConfig(megatron={"num_layers": 3}), tiny_model_dir)
    with pytest.raises(ValueError, match="not TransformerConfig fields"):
        Trainer(TrainerConfig(megatron={"no_such_field": 1}), tiny_model_dir)


def test_the_trainer_takes_model_directories_not_preset_names(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="model_dir must be an HF model directory .* got 'tiny'"):
        Trainer(TrainerConfig(), "tiny")  # resolving a preset is the caller's job
    teacher = TrainerConfig(opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model=str(tmp_path)))
    with pytest.raises(ValueError, match="teacher_model must be an HF model directory"):
        Trainer(teacher, tiny_model_dir)


# -- logprobs and packing -------------------------------------------------------------------
def test_packed_forward_matches_one_sequence_at_a_time(trainer, hf_tiny):
    samples = _samples(6)
    packed = trainer.logprobs([build_micro_batch(samples, range(6))])[0]
    single = torch.cat([trainer.logprobs([build_micro_batch(samples, [i])])[0] for i in range(6)])
    # reference: HF on each sequence alone
    ref = []
    for s in samples:
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([s.tokens])).logits[0, s.prompt_len - 1 : -1]
        ref.append(
            torch.log_softmax(logits, -1).gather(1, torch.tensor(s.tokens[s.prompt_len :])[:, None])[:, 0]
        )
    ref = torch.cat(ref)
    print(
        f"\npacked vs single max |Δ| = {(packed - single).abs().max():.2e}, vs HF {(packed - ref).abs().max():.2e}"
    )
    # Same math, different GEMM shapes: agreement to about one float32 ulp at |logprob| ~ 8.
    assert (packed - single).abs().max() <= 2e-6
    assert (packed - ref).abs().max() <= 2e-6
    # the separation is real: the same tokens as one long sequence give very different logprobs
    mb = build_micro_batch(samples, range(6))
    merged = dataclasses.replace(
        mb, cu_seqlens=torch.tensor([0, mb.num_tokens], dtype=torch.int32),
        position_ids=torch.arange(mb.num_tokens), sample_indices=[0], response_offsets=[0, mb.num_rows],
    )  # fmt: skip
    assert (trainer.logprobs([merged])[0] - packed).abs().max() > 1e-3


def test_vocab_parallel_logprobs_and_entropy_match_torch(trainer):
    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0)) * 3
    targets = torch.tensor([0, 7, 4095, 100, 5])
    for t in (1.0, 0.7, 0.0):
        scaled = torch.log_softmax(logits / (t or 1.0), -1)
        got = losses.vocab_parallel_logprobs(logits, targets, t)
        assert torch.allclose(got, scaled[torch.arange(5), targets], atol=1e-5)
        want_h = -(scaled.exp() * scaled).sum(-1)
        assert torch.allclose(losses.vocab_parallel_entropy(logits, t), want_h, atol=1e-4)


# -- snapshots ------------------------------------------------------------------------------
def test_snapshot_switch_restores_exactly(trainer):
    from palaestra.trainer.snapshots import SnapshotStore

    store = SnapshotStore(trainer.gpt)
    original = {k: v.clone() for k, v in trainer.megatron_state().items()}
    store.save("ref")
    with torch.no_grad():
        for p in trainer.gpt.parameters():
            p.add_(0.01)
    store.mark_live_changed()
    changed = {k: v.clone() for k, v in trainer.megatron_state().items()}
    store.switch("ref")
    assert all(torch.equal(v, original[k]) for k, v in trainer.megatron_state().items())
    store.copy("ref", "teacher")
    store.switch("actor")
    assert all(torch.equal(v, changed[k]) for k, v in trainer.megatron_state().items())
    store.switch("teacher")
    assert all(torch.equal(v, original[k]) for k, v in trainer.megatron_state().items())
    store.switch("actor")
    with pytest.raises(KeyError, match="no snapshot 'nope'"):
        store.switch("nope")
    trainer.load_megatron_state(original)  # leave the shared trainer as it was
    trainer.snapshots.mark_live_changed()


def test_single_snapshot_keeps_only_a_fingerprint(trainer):
    from palaestra.trainer.snapshots import SnapshotStore

    store = SnapshotStore(trainer.gpt)
    assert store.tags == ["actor"] and store.host_bytes == 0  # no copy of the weights
    store.switch("actor")  # unchanged: passes
    p = next(trainer.gpt.parameters())
    with torch.no_grad():
        p.view(-1)[0] += 1.0
    with pytest.raises(RuntimeError, match="no longer match snapshot 'actor'"):
        store.switch("actor")
    store.mark_live_changed()
    store.switch("actor")
    with torch.no_grad():
        p.view(-1)[0] -= 1.0
    trainer.snapshots.mark_live_changed()


# -- training -------------------------------------------------------------------------------
def _surrogate(trainer: Trainer, mbs) -> float:
    """Σ A_t · lp_t over loss tokens / count: what the policy gradient increases."""
    lps = trainer.logprobs(mbs)
    num = sum(float((mb.advantages * lp * mb.loss_mask).sum()) for mb, lp in zip(mbs, lps, strict=True))
    return num / sum(float(mb.loss_mask.sum()) for mb in mbs)


def test_optimizer_steps_on_a_fixed_batch_lower_the_loss(tiny_model_dir):
    t = Trainer(TrainerConfig(megatron_optimizer={"lr": 3e-3}, max_tokens_per_microbatch=128), tiny_model_dir)
    samples = _samples(12, seed=3)
    mbs, _ = t._schedule(samples)
    t._store(mbs, "old_logprobs", t.logprobs(mbs))
    t._advantages(samples, mbs)
    before = _surrogate(t, mbs)
    for _ in range(3):
        metrics = t.step(samples)
    after = _surrogate(t, mbs)
    print(f"\npolicy loss -J: {-before:.4f} -> {-after:.4f}; grad_norm {metrics['train/grad_norm']:.3f}")
    assert metrics["perf/microbatches"] > 1  # several packed micro-batches, one optimizer step each call
    assert -after < -before - 0.05


def test_pure_distillation_moves_the_student_to_the_teacher(tiny_model_dir, tmp_path):
    # Teacher: tiny with perturbed weights (same architecture: megatron mode swaps it in).
    t = Trainer(TrainerConfig(), tiny_model_dir)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in t.gpt.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    teacher_dir = t.export_hf(tmp_path / "teacher")
    cfg = TrainerConfig(
        megatron_optimizer={"lr": 1e-3},
        opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model=str(teacher_dir)),
    )
    student = Trainer(cfg, tiny_model_dir)
    samples = _samples(8, seed=5)
    for s in samples:
        s.reward = 0.0  # A = 0: the teacher is the only signal

    def gap() -> float:  # mean (log πθ − log π_teacher)² over the batch's tokens
        mbs, _ = student._schedule(samples)
        lp, teacher = student.logprobs(mbs), student.logprobs(mbs, tag="teacher/teacher", temperature=1.0)
        return float(torch.cat([(a - b) ** 2 for a, b in zip(lp, teacher, strict=True)]).mean())

    before = gap()
    metrics = [student.step(samples) for _ in range(4)]
    after = gap()
    print(f"\nstudent-teacher logprob gap {before:.4f} -> {after:.4f}; "
          f"opd/reverse_kl per step {[round(m['opd/reverse_kl'], 4) for m in metrics]}")  # fmt: skip
    assert after < 0.5 * before
    assert student.snapshots.live == "actor" and set(student.snapshots.tags) == {"actor", "teacher/teacher"}


def test_old_actor_holds_the_weights_before_the_previous_update(tiny_model_dir):
    samples = _samples(6, seed=4)
    on_policy = Trainer(TrainerConfig(megatron_optimizer={"lr": 1e-3}), tiny_model_dir)
    off_policy = Trainer(TrainerConfig(megatron_optimizer={"lr": 1e-3}, keep_old_actor=True), tiny_model_dir)
    for t in (on_policy, off_policy):
        first = t.step(samples)
        assert first["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # old = live weights
    # second step: on-policy recomputes "old" with the live weights (ratio 1 at the first
    # gradient); with keep_old_actor "old" is the pre-step-1 model, so the ratio moved
    assert on_policy.step(samples)["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    second = off_policy.step(samples)
    assert abs(second["train/ratio_mean"] - 1.0) > 1e-3
    print("\n" + format_metrics(second))
    assert "loss=" in format_metrics(second) and "step=2" in format_metrics(second)


def test_checkpoint_resume_is_exact(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(megatron_optimizer={"lr": 1e-3}, keep_old_actor=True, kl=KlOptions(coef=0.1))
    a = Trainer(cfg, tiny_model_dir)
    s1, s2 = _samples(6, seed=1), _samples(6, seed=2)
    a.step(s1)
    a.save(tmp_path / "ckpt")
    ma = a.step(s2)
    b = Trainer(cfg, tiny_model_dir)
    b.load(tmp_path / "ckpt")
    assert (b.step_count, b.weight_version) == (1, 1)
    mb_ = b.step(s2)
    assert mb_["train/loss"] == ma["train/loss"] and mb_["train/kl"] == ma["train/kl"]
    sa, sb = a.megatron_state(), b.megatron_state()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.weight_version == 2


# -- the CPU shim --------------------------------------------------------------------------
def test_cpu_shim_is_active_and_narrow(trainer):
    import importlib

    assert cpu_shim.installed() == (not torch.cuda.is_available())
    if torch.cuda.is_available():
        pytest.skip("the shim is a no-op with CUDA; nothing to check")
    for name in cpu_shim.PATCHED_MODULES:
        module = importlib.import_module(name)
        assert module.torch is not torch and module.torch.cuda.current_device() == "cpu"
        assert module.torch.zeros(2, device="cuda").device.type == "cpu"
    assert (
        torch.cuda.current_device
        is not importlib.import_module(cpu_shim.PATCHED_MODULES[0]).torch.cuda.current_device
    )
    with pytest.raises(ValueError, match="use_distributed_optimizer needs CUDA"):
        cpu_shim.check_supported({"use_distributed_optimizer": True})
    with pytest.raises(RuntimeError, match="already exist"):
        from palaestra.trainer.megatron_model import init_parallel

        init_parallel({"tensor_model_parallel_size": 2})


def test_dp_size_must_match_the_ranks_started(tiny_model_dir):
    with pytest.raises(
        ValueError, match="dp_size is 2, but 1 ranks with tensor_model_parallel_size 1 make 1"
    ):
        Trainer(TrainerConfig(dp_size=2), tiny_model_dir)
