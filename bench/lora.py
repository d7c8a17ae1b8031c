"""LoRA benchmark: adapter-only weight sync vs the whole model, and a trainer step, LoRA vs full.

    .venv/bin/python -m bench.lora [--models tiny,smollm2-135m] [--ranks 8,16,64] [--parts sync,step]

Prints, from one run:
* sync: per model, one embedded engine started with --enable-lora, and in each round (interleaved,
  so the machine's load weighs on all alike) a whole-model push (shm mode: one safetensors file in
  /dev/shm + /update_weights_from_disk, the default full fine-tuning sync) and an adapter push of
  each rank (a PEFT directory loaded under its own name while the engine generates, then
  /unload_lora_adapter + /load_lora_adapter of the served name inside the pause;
  trainer/lora_sync.py), every projection adapted, and rank 16 on the attention projections only
  (r16-attn). Bytes sent, the whole push and the time the engine was paused (generated nothing),
  medians over the rounds, and each as a fraction of the full push's.
* step: per model, a full fine-tuning trainer and a LoRA one (rank --step-rank) in their own
  processes, the same batch, stepping in turn (one steps while the other waits, so the machine's
  load weighs on both alike): the median step time of --steps steps after a warm-up step, the
  process's peak RSS (ru_maxrss), and the bytes the trainer holds beyond the model's weights
  (gradients, optimizer state, the `ref` snapshot that LoRA does without).
* learn: real `palaestra train` runs of configs/demo.yaml (the Python API, the CLI's code path),
  the same seeds and task order, full fine-tuning and LoRA (rank --step-rank, --lora-lr), held-out
  accuracy every --eval-every steps. `--arms full` and `--arms lora` run one arm each (to keep each
  run short); the curves of earlier runs are compared by step.

    .venv/bin/python -m bench.lora --parts learn --arms lora --train-steps 30 --eval-every 10

Absolute numbers depend on this machine's load; the ratios are what to compare between runs.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import common
from palaestra.models import resolve_model
from palaestra.sample import Sample

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_adapter(model_dir: Path, rank: int, targets=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT config and factors of `rank` on `targets` (default: every projection) of `model_dir`
    (the shapes the trainer's adapters have; their values do not change the bytes)."""
    from transformers import AutoConfig

    from palaestra.trainer.convert import HFArchitecture
    from palaestra.trainer.lora import PROJECTIONS, LoraOptions, projection_shapes

    arch = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(model_dir))
    shapes = projection_shapes(arch)
    targets = tuple(targets or PROJECTIONS)
    tensors = {}
    for layer in range(arch.num_layers):
        for p in targets:
            parent = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out_dim, in_dim = shapes[p]
            name = f"base_model.model.model.layers.{layer}.{parent}.{p}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_dim) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_dim, rank) * 0.01
    o = LoraOptions(rank=rank)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": rank, "lora_alpha": o.alpha, "lora_dropout": 0.0, "target_modules": list(targets),
              "bias": "none"}  # fmt: skip
    return config, tensors


def sync_bench(model: str, ranks: list[int], rounds: int) -> None:
    from safetensors.torch import load_file

    from palaestra.engine.cli import engine_process
    from palaestra.trainer.weight_sync import WeightSync
    from palaestra.weights_format import base_checksum

    model_dir = resolve_model(model)
    named = [
        (k, v.clone()) for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()
    ]
    checksum = base_checksum(named)
    adapters = {f"r{r}": random_adapter(model_dir, r) for r in ranks}
    adapters["r16-attn"] = random_adapter(model_dir, 16, ATTENTION)  # q, k, v, o only
    results: dict[str, list] = {"full": [], **{key: [] for key in adapters}}
    extra = ["--num-threads", "1", "--enable-lora", "--max-loras-per-batch", "1"]
    with engine_process(str(model_dir), extra_args=extra) as engine:
        full = WeightSync([engine.url], mode="shm")
        lora = {key: WeightSync([engine.url], mode="shm") for key in adapters}
        full.push(named, "warmup")
        for key, (config, tensors) in adapters.items():
            lora[key].push_adapter(f"bench-{key}", config, tensors, "warmup", checksum)
        for v in range(rounds):
            results["full"].append(full.push(named, f"full-{v}"))
            for key, (config, tensors) in adapters.items():
                results[key].append(
                    lora[key].push_adapter(f"bench-{key}", config, tensors, f"{key}-{v}", checksum)
                )
        for s in (full, *lora.values()):
            s.close()

    def med(reports, attr):
        return statistics.median(getattr(x, attr) for x in reports)

    f_bytes, f_s, f_pause = (
        med(results["full"], "bytes"),
        med(results["full"], "seconds"),
        med(results["full"], "pause_seconds"),
    )
    params = sum(t.numel() for _, t in named)
    print(
        f"\nsync to 1 embedded engine, {model} ({params / 1e6:.1f} M parameters), {rounds} interleaved rounds, medians:"
    )
    print(
        f"  {'':9s} {'MB sent':>10s} {'push ms':>9s} {'paused ms':>10s}   {'bytes/full':>10s} {'push/full':>9s} {'paused/full':>11s}"
    )
    for key, reports in results.items():
        b, s, p = med(reports, "bytes"), med(reports, "seconds"), med(reports, "pause_seconds")
        print(f"  {key:9s} {b / 1e6:10.3f} {s * 1e3:9.1f} {p * 1e3:10.1f}   {b / f_bytes:10.4f} {s / f_s:9.3f} {p / f_pause:11.3f}"
              + ("" if key == "full" else f"   (1/{f_bytes / b:.0f} of the bytes, 1/{f_pause / p:.1f} of the pause)"))  # fmt: skip


def batch(vocab: int, n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))]
        s = Sample(sample_id=f"b{i}", session_id=f"b{i}", group_id=f"g{i // 8}", env="bench", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(i % 3 == 0))  # fmt: skip
        resp = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))]
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


def tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def one_trainer(model: str, rank: int, samples: int) -> None:
    """In this process: a trainer (LoRA if rank > 0) of `model` that steps on the batch each time
    a line ``step`` arrives on stdin (printing the seconds), and on ``done`` prints its memory."""
    from palaestra.trainer import Trainer, TrainerConfig
    from palaestra.trainer.config import KlOptions

    torch.set_num_threads(1)
    cfg = TrainerConfig(
        lora={"rank": rank} if rank else {}, megatron_optimizer={"lr": 1e-5}, kl=KlOptions(coef=0.01)
    )
    t0 = time.perf_counter()
    t = Trainer(cfg, resolve_model(model))
    build_s = time.perf_counter() - t0
    data = batch(t.arch.vocab_size, samples)
    t.step(data)  # warm-up: the optimizer's state is allocated here
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        t.step(data)
        print(time.perf_counter() - t0, flush=True)
    trainable = [p for p in t.gpt.parameters() if p.requires_grad]
    opt_bytes = tensor_bytes(t.optimizer.state_dict())  # Adam's moments (and any master copies)
    weights = sum(p.numel() * p.element_size() for p in t.gpt.parameters())
    summary = {
        "build_s": build_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights_mb": weights / 1e6,
        "trainable": sum(p.numel() for p in trainable),
        "grad_mb": sum(p.numel() * 4 for p in trainable) / 1e6,  # DDP's fp32 gradient buffer
        "optimizer_mb": opt_bytes / 1e6,
        "snapshots_mb": t.snapshots.host_bytes / 1e6,
        "tokens": sum(len(s.tokens) for s in data),
    }
    print(json.dumps(summary), flush=True)


def step_bench(model: str, rank: int, samples: int, steps: int) -> None:
    """Two trainer processes (full, LoRA), each its own ru_maxrss, stepping in turn: each step
    runs while the other trainer waits, so the machine's load weighs on both alike."""
    procs = {}
    for r in (0, rank):
        cmd = [sys.executable, __file__, "--one-trainer", model, str(r), str(samples)]
        procs[r] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def answer(r: int) -> str:
        line = procs[r].stdout.readline()
        if not line:
            raise RuntimeError(f"the trainer of rank {r} exited ({procs[r].wait()})")
        return line.strip()

    for r in procs:  # both built and warmed up
        while answer(r) != "ready":
            pass
    times: dict[int, list[float]] = {r: [] for r in procs}
    for _ in range(steps):
        for r, proc in procs.items():
            proc.stdin.write("step\n")
            proc.stdin.flush()
            times[r].append(float(answer(r)))
    runs = {}
    for r, proc in procs.items():
        proc.stdin.write("done\n")
        proc.stdin.flush()
        runs[r] = {**json.loads(answer(r)), "step_s": statistics.median(times[r])}
        proc.wait()
    full, lo = runs[0], runs[rank]
    print(f"\ntrainer step, {model}, the same {samples} samples ({full['tokens']} tokens), median of {steps} steps, "
          f"each trainer in its own process, stepping in turn:")  # fmt: skip
    print(
        f"  {'':12s} {'step s':>7s} {'peak RSS MB':>12s} {'trainable':>11s} {'grads MB':>9s} {'optim MB':>9s} {'ref snap MB':>12s}"
    )
    for name, x in (("full", full), (f"LoRA r{rank}", lo)):
        print(f"  {name:12s} {x['step_s']:7.2f} {x['peak_rss_mb']:12.0f} {x['trainable']:11,d} {x['grad_mb']:9.1f} "
              f"{x['optimizer_mb']:9.1f} {x['snapshots_mb']:12.1f}")  # fmt: skip
    extra_full = full["grad_mb"] + full["optimizer_mb"] + full["snapshots_mb"]
    extra_lora = lo["grad_mb"] + lo["optimizer_mb"] + lo["snapshots_mb"]
    print(f"  LoRA/full: step time {lo['step_s'] / full['step_s']:.2f}, peak RSS {lo['peak_rss_mb'] / full['peak_rss_mb']:.2f}, "
          f"memory beyond the weights (grads + optimizer + ref) {extra_lora:.1f} / {extra_full:.1f} MB = "
          f"{extra_lora / extra_full:.3f} (the ref snapshot saved: {full['snapshots_mb']:.1f} MB)")  # fmt: skip


def learn(
    arm: str, rank: int, lr: float | None, steps: int, eval_every: int, eval_tasks: int, extra: list[str]
) -> None:
    import tempfile

    from bench.common import train_demo

    overrides = [f"run.steps={steps}", f"env.eval_every={eval_every}", f"env.eval_tasks={eval_tasks}", *extra]
    if arm == "lora":
        overrides.append(f"trainer.lora.rank={rank}")
        if lr is not None:
            overrides.append(f"trainer.megatron_optimizer.lr={lr}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = train_demo(Path(tmp) / arm, f"lora-{arm}", overrides).state.rows
    curve = [(int(r["train/step"]), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]

    def median(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    label = arm if arm == "full" else f"LoRA r{rank}" + (f" lr {lr:g}" if lr is not None else "")
    print(f"\nlearn, {label}: held-out accuracy (greedy, {eval_tasks} tasks) by step: "
          + ", ".join(f"{s}: {a:.3f}" for s, a in curve)
          + f"; {time.perf_counter() - t0:.0f} s wall; medians per step: step {median('perf/step_wall_s'):.1f} s, "
          f"train {median('perf/train_s'):.2f} s, sync {median('perf/sync_s') * 1e3:.0f} ms "
          f"({median('perf/sync_bytes') / 1e6:.2f} MB, engines paused {median('perf/sync_pause_s') * 1e3:.0f} ms)")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one-trainer":
        one_trainer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = common.parser(__doc__)
    ap.add_argument(
        "--models", default="tiny,smollm2-135m", help="presets or HF directories (default: %(default)s)"
    )
    ap.add_argument(
        "--ranks", default="8,16,64", help="LoRA ranks of the sync section (default: %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed pushes of each kind (default: %(default)s)")
    ap.add_argument(
        "--step-rank", type=int, default=16, help="LoRA rank of the step section (default: %(default)s)"
    )
    ap.add_argument("--samples", type=int, default=16, help="samples in the step section's batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per trainer (after a warm-up step)")
    ap.add_argument("--parts", default="sync,step", help="sections: sync, step, learn (default: %(default)s)")
    ap.add_argument("--arms", default="full,lora", help="learn: full and/or lora (default: %(default)s)")
    ap.add_argument("--lora-lr", type=float, default=None, help="learn: LoRA's lr (default: the demo's)")
    ap.add_argument("--train-steps", type=int, default=30, help="learn: steps per run")
    ap.add_argument("--eval-every", type=int, default=10, help="learn: held-out evaluation every N steps")
    ap.add_argument("--eval-tasks", type=int, default=200, help="learn: held-out tasks")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="learn: another override of configs/demo.yaml, for both arms (e.g. model.teacher=null)",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "learn" in parts:
        for arm in args.arms.split(","):
            learn(
                arm,
                args.step_rank,
                args.lora_lr,
                args.train_steps,
                args.eval_every,
                args.eval_tasks,
                args.set,
            )
    for model in args.models.split(",") if parts - {"learn"} else []:
        if "sync" in parts:
            sync_bench(model, [int(r) for r in args.ranks.split(",")], args.rounds)
        if "step" in parts:
            step_bench(model, args.step_rank, args.samples, args.steps)


if __name__ == "__main__":
    main()
