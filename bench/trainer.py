"""Trainer benchmark: throughput, packing, DP balance, snapshot and weight-sync bandwidth, as ratios.

    .venv/bin/python -m bench.trainer [--model tiny] [--samples 64] [--ranks 8]

Prints, from one run:
* forward+backward tokens/s of the Megatron model on packed micro-batches, against HF transformers
  doing forward+backward on the same samples one at a time (no padding either way);
* a whole `Trainer.step` with the old-policy logprobs taken from the update's own forward (the
  default where nothing needs them first: `Trainer.separate_old_pass`) against a pass of their own;
* packing efficiency: real tokens / processed tokens for THD packing vs padding each micro-batch to
  its longest sample, and how full the packs are;
* max/mean DP rank load (estimated FLOPs) of the default schedule (Karmarkar-Karp over samples,
  then packing per rank) vs round-robin, on a long-tailed (Pareto) length distribution, and of the
  pack-first order;
* snapshot switch as a fraction of a plain memcpy of the same bytes;
* weight sync to a real embedded engine, per mode (tensor: base64 buckets over HTTP; shm: one
  safetensors file in /dev/shm + /update_weights_from_disk), as a fraction of a memcpy of the same
  bytes timed around each push (one copy each, like the push), for the whole push and for the
  pause alone (the time the engine does not generate), with the median milliseconds per phase
  (stage, pause, write, update, version, continue).

    .venv/bin/python -m bench.trainer --parts balance,sync     # only those sections
Absolute numbers depend on this machine's load; the ratios are what to compare between runs.
"""

from __future__ import annotations

import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bench import common
from palaestra.models import resolve_model
from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.config import KlOptions
from palaestra.trainer.packing import round_robin, schedule, sequence_flops


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
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny", help="preset or HF directory (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=64, help="samples in the throughput batch")
    ap.add_argument("--max-tokens", type=int, default=2048, help="max_tokens_per_microbatch")
    ap.add_argument("--ranks", type=int, default=8, help="DP ranks in the balance test")
    ap.add_argument("--sync-hidden", type=int, default=1024,
                    help="hidden size of the model the sync section pushes (the trainer model's "
                         "architecture widened, random weights; 0 = the --model itself)")  # fmt: skip
    ap.add_argument("--sync-rounds", type=int, default=7, help="timed pushes per sync mode")
    ap.add_argument(
        "--step-rounds", type=int, default=5, help="timed steps per way of taking the old logprobs"
    )
    ap.add_argument("--parts", default="throughput,step,balance,snapshot,sync",
                    help="comma-separated sections to run (default: all: %(default)s)")  # fmt: skip
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    config = TrainerConfig(max_tokens_per_microbatch=args.max_tokens, kl=KlOptions(coef=0.01))
    trainer = Trainer(config, resolve_model(args.model))
    vocab = trainer.arch.vocab_size

    if "throughput" in parts:
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
            trainer._run(mbs, partial(trainer._policy_loss, None), forward_only=False)

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

    if "step" in parts:
        # -- a whole step, the old-policy logprobs from the update's forward or a pass of their own --
        samples = long_tailed_samples(args.samples, 2, vocab, 1024)
        fused, apart = [], []  # alternating, so that both see the same machine
        for i in range(2 * args.step_rounds + 2):
            if i % 2:  # this step with the pass apart, as a configuration that needs it runs
                trainer.separate_old_pass = lambda k=0: "measured with a pass of its own"
            m = trainer.step(samples)
            vars(trainer).pop("separate_old_pass", None)  # the class's own again
            if i >= 2:  # the first of each: warm-up
                (apart if i % 2 else fused).append(m)

        def median(rows: list[dict[str, float]], key: str) -> float:
            return sorted(r[key] for r in rows)[len(rows) // 2]

        assert [r["perf/old_pass_fused"] for r in fused + apart] == [1.0] * len(fused) + [0.0] * len(apart)
        f, a = median(fused, "perf/step_s"), median(apart, "perf/step_s")
        print(f"step ({len(samples)} samples, {sum(len(s.tokens) for s in samples)} tokens, kl.coef 0.01, "
              f"median of {args.step_rounds}): old logprobs from the update's forward {f:.3f} s, from a pass of "
              f"their own {a:.3f} s -> {f / a:.3f}x the time (old+ref passes {median(fused, 'perf/score_s'):.3f} "
              f"vs {median(apart, 'perf/score_s'):.3f} s, update {median(fused, 'perf/update_s'):.3f} vs "
              f"{median(apart, 'perf/update_s'):.3f} s)")  # fmt: skip

    if "balance" in parts:
        # -- packing efficiency ---------------------------------------------------------------------
        lengths = [len(s.tokens) for s in long_tailed_samples(1024, 1, vocab, 4096)]
        plan = schedule(lengths, args.max_tokens, 1, trainer.arch)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in plan.bins)
        print(f"packing ({len(lengths)} long-tailed samples, {args.max_tokens}-token micro-batches): "
              f"real/processed tokens THD = 1.000 (no padding), padded-per-micro-batch = {sum(lengths) / padded:.3f}; "
              f"micro-batches {len(plan.bins)} at fill ratio {plan.fill_ratio(args.max_tokens):.3f}")  # fmt: skip

        # -- DP balance -----------------------------------------------------------------------------
        def max_over_mean(weights: list[float], split: list[list[int]]) -> float:
            return max(sum(weights[i] for i in p) for p in split) / (sum(weights) / args.ranks)

        costs = [sequence_flops(n, trainer.arch) for n in lengths]
        kk_plan = schedule(lengths, args.max_tokens, args.ranks, trainer.arch)  # the default order
        kk = max_over_mean(kk_plan.bin_flops, kk_plan.per_rank)
        rr = max_over_mean(costs, round_robin(len(lengths), args.ranks))  # sample i -> rank i mod k
        pf = schedule(lengths, args.max_tokens, args.ranks, trainer.arch, order="pack_first")
        kk_pf = max_over_mean(pf.bin_flops, pf.per_rank)
        rr_pf = max_over_mean(pf.bin_flops, round_robin(len(pf.bins), args.ranks))
        print(f"DP balance over {args.ranks} ranks, max/mean rank load (estimated FLOPs, same {len(lengths)} samples; "
              f"goal <= 1.02):"
              f"\n  default (Karmarkar-Karp over samples, then pack) = {kk:.4f} vs round-robin over samples = {rr:.4f} "
              f"-> {rr / kk:.3f}x lower peak ({len(kk_plan.bins)} micro-batches)"
              f"\n  pack_first (pack, then Karmarkar-Karp over micro-batches) = {kk_pf:.4f} vs round-robin over the "
              f"same micro-batches = {rr_pf:.4f} ({len(pf.bins)} micro-batches)")  # fmt: skip

    if "snapshot" in parts:
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
    if "sync" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            model = (
                widened(trainer.model_dir, Path(tmp), args.sync_hidden) if args.sync_hidden else args.model
            )
            weight_sync(model, args.sync_rounds)


def widened(model_dir: Path, out: Path, hidden: int) -> Path:
    """`model_dir`'s architecture and tokenizer at hidden size `hidden` (random weights, head size
    kept): a model large enough that a sync moves more than a few milliseconds of bytes."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = AutoConfig.from_pretrained(model_dir)
    scale = hidden / cfg.hidden_size
    head = cfg.hidden_size // cfg.num_attention_heads
    cfg.hidden_size, cfg.intermediate_size = hidden, int(cfg.intermediate_size * scale)
    cfg.num_attention_heads = hidden // head
    cfg.num_key_value_heads = max(1, int(cfg.num_key_value_heads * scale))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    marker = out / "palaestra_preset.json"
    if marker.exists():  # not the preset any more
        marker.unlink()
    json.loads((out / "config.json").read_text())  # written and readable
    return out


class Memcpy:
    """One timed copy of `nbytes` between two buffers allocated and touched once, so that each
    measurement is a single copy into warm pages, like the shm write into the mapped file."""

    def __init__(self, nbytes: int):
        self.src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


def weight_sync(model: str | Path, rounds: int) -> None:
    """tensor vs shm sync of the whole model to a real embedded engine, interleaved, as ratios.

    Each push is one shot, and so is its denominator: a memcpy of the same bytes timed just before
    and just after it (their mean), so the machine's load weighs on both alike."""
    from safetensors.torch import load_file

    from palaestra.engine.cli import engine_process
    from palaestra.models import resolve_model
    from palaestra.trainer.weight_sync import WeightSync

    model_dir = resolve_model(str(model))
    # cloned: in memory like the trainer's hf_state(), not pages of the file on disk
    named = [
        (k, v.clone()) for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    memcpy = Memcpy(nbytes)
    with engine_process(str(model_dir), extra_args=["--num-threads", "1"]) as engine:
        syncs = {m: WeightSync([engine.url], mode=m, bucket_mb=64) for m in ("tensor", "shm")}
        results: dict[str, list[tuple[float, object]]] = {m: [] for m in syncs}
        for m, sync in syncs.items():
            sync.push(named, f"warmup-{m}")
        for v in range(rounds):  # interleaved: the machine's load moves, the ratio within a round less so
            for m, sync in syncs.items():
                before = memcpy()
                report = sync.push(named, f"{m}-{v}")
                results[m].append(((before + memcpy()) / 2, report))
        for sync in syncs.values():
            sync.close()
    copies = sorted(c for rs in results.values() for c, _ in rs)
    print(f"weight sync of the whole model ({nbytes / 1e6:.1f} MB, {len(named)} tensors) to 1 embedded engine, "
          f"{rounds} rounds; memcpy of the same bytes (one copy each, around every push) median "
          f"{copies[len(copies) // 2] * 1e3:.1f} ms [best {copies[0] * 1e3:.1f} ms]; fraction of memcpy: "
          f"median of the rounds [best round]:")  # fmt: skip
    for m, rs in results.items():
        mid = len(rs) // 2
        whole = sorted(c / r.seconds for c, r in rs)
        paused = sorted(c / r.pause_seconds for c, r in rs)
        pause_ms = sorted(r.pause_seconds * 1e3 for _, r in rs)
        first = getattr(rs[0][1], "phases", {})  # (older SyncReports have none: the bench runs on either)
        phases = {k: sorted(r.phases.get(k, 0.0) for _, r in rs)[mid] * 1e3 for k in first}
        whole_ms = sorted(r.seconds * 1e3 for _, r in rs)[mid]
        if first:  # the whole push less its phases, per round: what no phase accounts for
            phases["other"] = sorted(r.seconds - sum(r.phases.values()) for _, r in rs)[mid] * 1e3
        print(f"  {m:6s}: whole push {whole_ms:.1f} ms, {whole[mid]:.3f} [{whole[-1]:.3f}] of memcpy "
              f"({nbytes / min(r.seconds for _, r in rs) / 1e9:.3f} GB/s best); engine paused "
              f"{pause_ms[mid]:.1f} ms per sync -> {paused[mid]:.3f} [{paused[-1]:.3f}] of memcpy"
              f"\n          median ms per phase: " + " | ".join(f"{k} {t:.1f}" for k, t in phases.items()))  # fmt: skip


if __name__ == "__main__":
    main()
