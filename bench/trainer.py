"""Trainer benchmark: throughput, packing, DP balance, snapshot and weight-sync bandwidth, as ratios.

    .venv/bin/python bench/trainer.py [--model tiny] [--samples 64] [--ranks 8]

Prints, from one run:
* forward+backward tokens/s of the Megatron model on packed micro-batches, against HF transformers
  doing forward+backward on the same samples one at a time (no padding either way);
* packing efficiency: real tokens / processed tokens for THD packing vs padding each micro-batch to
  its longest sample, and how full the packs are;
* Karmarkar-Karp max/mean rank load (estimated FLOPs) vs round-robin, on a long-tailed (Pareto)
  length distribution, for the DP schedule (balanced micro-batches) and for plain first-fit ones;
* snapshot switch and weight sync (to a real embedded engine, /update_weights_from_tensor) as a
  fraction of a plain memcpy of the same bytes.
Absolute numbers depend on this machine's load; the ratios are what to compare between runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from palaestra.models import resolve_model  # noqa: E402
from palaestra.sample import Sample  # noqa: E402
from palaestra.trainer import Trainer, TrainerConfig  # noqa: E402
from palaestra.trainer.packing import karmarkar_karp, round_robin, schedule, sequence_flops  # noqa: E402


def long_tailed_samples(n: int, seed: int, vocab: int, max_len: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = min(max_len, int(32 * rng.paretovariate(1.3)))
        prompt = [rng.randrange(3, vocab) for _ in range(max(2, length // 4))]
        resp = [rng.randrange(3, vocab) for _ in range(max(2, length - len(prompt)))]
        s = Sample(sample_id=f"b{i}", session_id=f"b{i}", group_id=f"g{i // 8}", env="bench", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(rng.random() < 0.5))  # fmt: skip
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return best_of(lambda: dst.copy_(src), 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or HF directory (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=64, help="samples in the throughput batch")
    ap.add_argument("--max-tokens", type=int, default=2048, help="max_tokens_per_microbatch")
    ap.add_argument("--ranks", type=int, default=8, help="DP ranks in the balance test")
    args = ap.parse_args()

    config = TrainerConfig(max_tokens_per_microbatch=args.max_tokens, kl_coef=0.01)
    trainer = Trainer(config, resolve_model(args.model))
    vocab = trainer.arch.vocab_size

    # -- forward+backward throughput ------------------------------------------------------------
    samples = long_tailed_samples(args.samples, 0, vocab, 1024)
    tokens = sum(len(s.tokens) for s in samples)
    mbs, _ = trainer._schedule(samples)
    trainer._store(mbs, "old_logprobs", trainer.logprobs(mbs))
    trainer._store(mbs, "ref_logprobs", [mb.old_logprobs for mb in mbs])
    trainer._advantages(samples, mbs)

    def megatron_fwd_bwd() -> None:
        trainer.model.train()
        trainer.model.zero_grad_buffer()
        trainer._run(mbs, trainer._policy_loss, forward_only=False)

    megatron_s = best_of(megatron_fwd_bwd)
    fwd_s = best_of(lambda: trainer.logprobs(mbs))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(trainer.model_dir, dtype=torch.float32).train()

    def hf_fwd_bwd() -> None:
        hf.zero_grad(set_to_none=True)
        for s in samples:
            logits = hf(torch.tensor([s.tokens])).logits[0, s.prompt_len - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.tokens[s.prompt_len :])[:, None])
            (-lp.mean()).backward()

    hf_s = best_of(hf_fwd_bwd, 2)
    print(f"forward+backward tokens/s ({tokens} tokens, {len(mbs)} packed micro-batches): "
          f"megatron = {tokens / megatron_s:,.0f}, HF one sample at a time = {tokens / hf_s:,.0f}  "
          f"-> {hf_s / megatron_s:.2f}x; forward only = {tokens / fwd_s:,.0f} tokens/s "
          f"(fwd+bwd costs {megatron_s / fwd_s:.2f}x a forward)")  # fmt: skip

    # -- packing efficiency ---------------------------------------------------------------------
    lengths = [len(s.tokens) for s in long_tailed_samples(1024, 1, vocab, 4096)]
    plan = schedule(lengths, args.max_tokens, 1, trainer.arch)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan.bins)
    print(f"packing ({len(lengths)} long-tailed samples, {args.max_tokens}-token micro-batches): "
          f"real/processed tokens THD = 1.000 (no padding), padded-per-micro-batch = {sum(lengths) / padded:.3f}; "
          f"micro-batches {len(plan.bins)} at fill ratio {plan.fill_ratio(args.max_tokens):.3f}")  # fmt: skip

    # -- DP balance -----------------------------------------------------------------------------
    def max_over_mean(weights: list[float], parts: list[list[int]]) -> float:
        return max(sum(weights[i] for i in p) for p in parts) / (sum(weights) / args.ranks)

    ffd = [sum(sequence_flops(lengths[i], trainer.arch) for i in b) for b in plan.bins]
    dp_plan = schedule(lengths, args.max_tokens, args.ranks, trainer.arch)
    balanced = dp_plan.bin_flops
    kk = max_over_mean(balanced, dp_plan.per_rank)
    rr = max_over_mean(balanced, round_robin(len(balanced), args.ranks))
    kk_ffd = max_over_mean(ffd, karmarkar_karp(ffd, args.ranks))
    alt = schedule(lengths, args.max_tokens, args.ranks, trainer.arch, order="distribute_first")
    kk_alt = max_over_mean(alt.bin_flops, alt.per_rank)
    print(f"DP balance over {args.ranks} ranks, max/mean rank load (estimated FLOPs, same samples; goal <= 1.02):"
          f"\n  pack first:       Karmarkar-Karp = {kk:.4f} vs round-robin = {rr:.4f} "
          f"({len(balanced)} balanced micro-batches; on the {len(ffd)} plain first-fit ones KK = {kk_ffd:.4f})"
          f"\n  distribute first: Karmarkar-Karp over samples, then pack = {kk_alt:.4f} ({len(alt.bins)} micro-batches)")  # fmt: skip

    # -- snapshot switch --------------------------------------------------------------------------
    store = trainer.snapshots
    nbytes = store.nbytes
    copy_s = memcpy_seconds(nbytes)

    def switch_round_trip() -> None:
        store.mark_live_changed()  # forces the full save of the live weights, as after a step
        store.switch("ref")
        store.switch("actor")

    switch_s = best_of(switch_round_trip, 5) / 3  # save actor + restore ref + restore actor
    print(f"snapshot switch ({nbytes / 1e6:.1f} MB): {nbytes / switch_s / 1e9:.2f} GB/s vs memcpy "
          f"{nbytes / copy_s / 1e9:.2f} GB/s -> {copy_s / switch_s:.2f} of memcpy")  # fmt: skip

    # -- weight sync --------------------------------------------------------------------------------
    from palaestra.engine.cli import engine_process
    from palaestra.trainer.weight_sync import WeightSync

    with engine_process(args.model, extra_args=["--num-threads", "1"]) as engine:
        sync = WeightSync([engine.url], mode="tensor", bucket_mb=64)
        named = list(trainer.hf_state().items())
        sync.push(named, "warmup")
        reports = [sync.push(named, str(v)) for v in range(3)]
        best = min(reports, key=lambda r: r.seconds)
        print(f"weight sync to 1 engine ({best.bytes / 1e6:.1f} MB, {best.buckets} bucket(s), pause -> "
              f"update -> flush -> version check -> continue): {best.bytes / best.seconds / 1e9:.3f} GB/s -> "
              f"{memcpy_seconds(best.bytes) / best.seconds:.4f} of memcpy")  # fmt: skip


if __name__ == "__main__":
    main()
