"""Does each OPD granularity lower the exact reverse KL of a real model, and at what batch size?

    .venv/bin/python -m bench.opd_estimators                     # sampled, topk, full at lr 3e-4
    .venv/bin/python -m bench.opd_estimators --granularities sampled --lrs 1e-4,3e-4,1e-3 \\
        --samples 16,64,256

No engines and no Ray: the Megatron trainer (`Trainer`, CPU) is the whole experiment, so one arm
takes a minute where a `palaestra train` run of the worked-steps task needs warm-started models
that take hours of SFT to build on a 2-core machine (docs/opd.md). The models are made here, in a
temporary directory: the `tiny` preset's random weights with the final norm scaled by `--sharpen`
(a random-init model is nearly uniform over its 4096 tokens; scaled, it is peaked like a trained
one) is the student, and the same weights plus Gaussian noise (`--noise` x each tensor's std) the
teacher. Every step samples `--samples` responses of `--length` tokens on-policy from the student
(an autoregressive loop over the trainer's own forward pass, temperature 1) for `--prompts`
random prompts and runs `Trainer.step` with advantage_estimator `none` (pure distillation, β = 1)
at the arm's granularity.

The figure is the **exact** per-token reverse KL, KL(π_student ‖ π_teacher) summed over the whole
vocabulary, averaged over the positions of on-policy responses (sampled afresh at each evaluation,
the same seed every time) to 32 prompts of the training set (the issue's check: repeated steps on
a fixed prompt set lower it) and to 32 held-out prompts. Also printed: `train/grad_norm` (before
clipping at `clip_grad` 1.0) and seconds per step. Each arm starts from the same student and
seeds. Run it with OMP_NUM_THREADS=1 on a shared machine (docs/opd.md: torch's second thread
made a loaded 2-core machine several times slower). Ratios within one run compare arms; the
machine's load moves the seconds.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from palaestra.models import resolve_model
from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.config import OpdOptions
from palaestra.trainer.opd_panel import snapshot_tag
from palaestra.trainer.packing import build_micro_batch

EVAL_PROMPTS, PROMPT_LEN, EVAL_SEED = 32, 4, 999
BASELINE = 0.0  # `--baseline`: set in this module as the trainer imports it (`constant_baseline`)


def constant_baseline(ctx) -> torch.Tensor:
    """An advantage estimator (by import path): b for every sample, so a sampled token's advantage
    is b − β·(log p − log q). E[∇ log p] = 0, so the gradient's mean is unchanged; with b near the
    reverse KL the advantages centre on 0 and the estimate's variance drops."""
    return torch.full((ctx.num_samples,), BASELINE)


def make_models(root: Path, sharpen: float, noise: float) -> tuple[Path, Path]:
    """(student, teacher) HF directories: tiny's weights, final norm x `sharpen`; the teacher + noise."""
    t = Trainer(TrainerConfig(), resolve_model("tiny"))
    with torch.no_grad():
        for name, p in t.gpt.named_parameters():
            if "final_layernorm" in name:
                p.mul_(sharpen)
        student = t.export_hf(root / "student")
        g = torch.Generator().manual_seed(7)
        for _, p in t.gpt.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.float().std().clamp(min=1e-3))
        teacher = t.export_hf(root / "teacher")
    del t
    return Path(student), Path(teacher)


def _prompts(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 4000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _next_rows(t: Trainer, seqs: list[list[int]], tag: str) -> torch.Tensor:
    """log_softmax of the next-token logits after each sequence, with weights `tag`: [N, V]."""
    samples = [
        Sample(sample_id=f"g{i}", session_id=f"g{i}", group_id="g", env="bench", task_id="",
               tokens=[*s, 0], prompt_len=len(s), loss_mask=[1], rollout_logprobs=[0.0], weight_versions=[""])
        for i, s in enumerate(seqs)
    ]  # fmt: skip
    mb = build_micro_batch(samples, list(range(len(samples))))
    out = t.forward_rows([mb], tag, lambda mb, rows: {"lp": torch.log_softmax(rows.float(), -1).cpu()})
    return out[0]["lp"]


def generate(t: Trainer, prompts: list[list[int]], length: int, g: torch.Generator) -> list[Sample]:
    """On-policy samples of the live student (temperature 1), with their rollout logprobs."""
    seqs, lps = [list(p) for p in prompts], [[] for _ in prompts]
    for _ in range(length):
        lp = _next_rows(t, seqs, "actor")
        x = torch.multinomial(lp.exp(), 1, generator=g).squeeze(1)
        for i, tok in enumerate(x.tolist()):
            seqs[i].append(tok)
            lps[i].append(float(lp[i, tok]))
    return [
        Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"p{i}", env="bench", task_id="",
               tokens=s, prompt_len=PROMPT_LEN, loss_mask=[1] * length, rollout_logprobs=lp,
               weight_versions=[""] * length)
        for i, (s, lp) in enumerate(zip(seqs, lps, strict=True))
    ]  # fmt: skip


def exact_reverse_kl(t: Trainer, prompts: list[list[int]], length: int) -> float:
    """Mean over the positions of on-policy responses of Σ_v p_v (log p_v − log q_v)."""
    samples = generate(t, prompts, length, torch.Generator().manual_seed(EVAL_SEED))
    mb = build_micro_batch(samples, list(range(len(samples))))
    full = lambda mb, rows: {"lp": torch.log_softmax(rows.float(), -1).cpu()}  # noqa: E731
    log_p = t.forward_rows([mb], "actor", full)[0]["lp"]
    log_q = t.forward_rows([mb], snapshot_tag("teacher"), full)[0]["lp"]
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def run_arm(
    student: Path, teacher: Path, granularity: str, lr: float, per_step: int, args: argparse.Namespace
) -> list[tuple[int, float, float, float, float]]:
    """(step, exact reverse KL on the training prompts, on held-out prompts, mean grad norm since the
    last evaluation, seconds per step) rows."""
    estimator = "opd_estimators:constant_baseline" if args.baseline else "none"
    cfg = TrainerConfig(
        temperature=1.0, advantage_estimator=estimator, megatron_optimizer={"lr": lr, "optimizer": args.optimizer},
        opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model=str(teacher), granularity=granularity,
                       topk=args.topk),
    )  # fmt: skip
    t = Trainer(cfg, str(student))
    rng, g = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    held_out = _prompts(EVAL_PROMPTS, random.Random(EVAL_SEED))
    train_prompts = _prompts(args.prompts, rng)  # a fixed prompt set, sampled afresh every step
    seen = [train_prompts[i % args.prompts] for i in range(EVAL_PROMPTS)]

    def kls() -> tuple[float, float]:
        return exact_reverse_kl(t, seen, args.length), exact_reverse_kl(t, held_out, args.length)

    rows = [(0, *kls(), float("nan"), float("nan"))]
    norms, seconds = [], []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        batch = [train_prompts[i % args.prompts] for i in range(per_step)]
        metrics = t.step(generate(t, batch, args.length, g))
        seconds.append(time.perf_counter() - started)
        norms.append(metrics["train/grad_norm"])
        if step % args.eval_every == 0 or step == args.steps:
            rows.append((step, *kls(), sum(norms) / len(norms), sum(seconds) / len(seconds)))
            norms, seconds = [], []
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--granularities", default="sampled,topk,full", help="comma-separated (default: %(default)s)"
    )
    ap.add_argument("--lrs", default="3e-4", help="comma-separated learning rates (default: %(default)s)")
    ap.add_argument("--samples", default="64", help="comma-separated samples per step (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="steps per arm (default: %(default)s)")
    ap.add_argument("--eval-every", type=int, default=5, help="(default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=16, help="training prompts (default: %(default)s)")
    ap.add_argument("--length", type=int, default=12, help="response tokens (default: %(default)s)")
    ap.add_argument("--topk", type=int, default=8, help="k of the topk arms (default: %(default)s)")
    ap.add_argument("--sharpen", type=float, default=12.0, help="final-norm scale (default: %(default)s)")
    ap.add_argument("--noise", type=float, default=0.25, help="teacher noise / std (default: %(default)s)")
    ap.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        default="adam",
        help="Megatron's optimizer (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--baseline",
        type=float,
        default=0.0,
        help="b added to every advantage of the sampled arms (0: none; default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if args.baseline:
        import opd_estimators  # the module the trainer's estimator path imports (not __main__)

        opd_estimators.BASELINE = args.baseline
    grans = [x.strip() for x in args.granularities.split(",") if x.strip()]
    lrs = [float(x) for x in args.lrs.split(",")]
    sizes = [int(x) for x in args.samples.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-opd-est-") as tmp:
        student, teacher = make_models(Path(tmp), args.sharpen, args.noise)
        for gran in grans:
            for lr in lrs:
                for n in sizes:
                    rows = run_arm(student, teacher, gran, lr, n, args)
                    results[(gran, lr, n)] = rows
                    seen = " ".join(f"{s}:{kl:.3f}" for s, kl, *_ in rows)
                    held = " ".join(f"{s}:{kl:.3f}" for s, _, kl, *_ in rows)
                    print(f"{gran:8s} lr {lr:.0e} {n:4d} samples/step: exact reverse KL, training prompts "
                          f"{seen}; held-out {held}", flush=True)  # fmt: skip
    print(f"\n== exact per-token reverse KL, {args.steps} steps, {args.length}-token responses to "
          f"{args.prompts} prompts, {args.optimizer}, baseline {args.baseline:g}; student tiny x{args.sharpen:g}, teacher + {args.noise:g} std noise")  # fmt: skip
    print(f"{'arm':30s} {'KL start':>9s} {'KL end':>9s} {'end/start':>9s} {'held-out':>9s} "
          f"{'grad norm':>9s} {'s/step':>7s}")  # fmt: skip
    for (gran, lr, n), rows in results.items():
        start, end = rows[0][1], rows[-1][1]
        held = rows[-1][2] / rows[0][2]
        norm = sum(r[3] for r in rows[1:]) / max(1, len(rows) - 1)
        sec = sum(r[4] for r in rows[1:]) / max(1, len(rows) - 1)
        arm = f"{gran} lr {lr:.0e} x{n} ({n * args.length} tok)"
        print(f"{arm:30s} {start:9.3f} {end:9.3f} {end / start:9.3f} {held:9.3f} {norm:9.2f} {sec:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
