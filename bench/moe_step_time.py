"""MoE trainer step time and memory: expert parallel 2 and pipeline parallel 2 against one process.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.moe_step_time              # tiny-moe, 5 timed steps
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.moe_step_time --layouts 1,ep2 --steps 10

Trainer only (no engine): each layout runs as gloo processes started here (as
tests/trainer/test_moe_parallel.py does), each a `Trainer` on the preset. `1`: one process; `ep2`:
two ranks with ``expert_model_parallel_size=2`` (they are also the two data-parallel ranks, each
trains half the batch and holds half the experts); `pp2`: two ranks with
``pipeline_model_parallel_size=2`` (one data-parallel replica, stage 0 the first half of the
layers); `pp2ep2`: four ranks, two stages of two data-parallel ranks that split the experts.
Tensor parallelism is not a layout here: the trainer refuses it on MoE models (megatron-core's MoE
layer needs sequence parallelism under TP, which its torch-norm local spec lacks). With
``--routing-replay r3`` every sequence carries random routed experts that every layout replays.
Printed besides: the first step's NLL and gradient norm, which every layout should reproduce. Every step is one `Trainer.step` on the same 16 sequences (prompts of 3-10 tokens,
responses of 6-90, ~800 tokens; SFT loss, Adam), fed by rank 0. Printed per layout: the median
step wall time over `--steps` steps after one untimed step (rank 0's), its ratio to one process,
and the peak resident memory of every rank (`resource.getrusage` maxrss, which includes the
Python/torch/Megatron imports). Run with OMP_NUM_THREADS=1: on a machine with fewer cores than
ranks, two processes share the cores and the ratio measures the communication and
duplication overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

LAYOUTS = {
    "1": (1, {}),
    "ep2": (2, {"expert_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2ep2": (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
}


def samples(arch=None):
    """16 sequences; given a MoE `arch`, each with random routed experts for routing_replay r3 (a row
    for every layer, as engines send them)."""
    import torch

    from palaestra.sample import Sample

    rng = random.Random(11)
    out = []
    for i in range(16):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 10))]
        s = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                   tokens=prompt, prompt_len=len(prompt))  # fmt: skip
        n = rng.choice([6, 10, 40, 90])
        s.append([rng.randrange(3, 4000) for _ in range(n)], sampled=True, logprobs=[-8.3] * n)
        if arch is not None:
            g = torch.Generator().manual_seed(i)
            rows = (len(s.tokens) - 1) * arch.num_layers
            experts = [torch.randperm(arch.num_experts, generator=g)[: arch.moe_topk] for _ in range(rows)]
            s.set_routing(torch.stack(experts).reshape(len(s.tokens) - 1, arch.num_layers, -1).numpy())
        out.append(s)
    return out


def worker(out: Path, model: str, megatron: dict, world: int, steps: int, replay: str) -> None:
    """One rank: builds the trainer, takes 1 + `steps` steps, writes its times, peak memory and the
    first step's NLL and gradient norm (which every layout should reproduce)."""
    from palaestra.models import resolve_model
    from palaestra.trainer import Trainer, TrainerConfig

    parallel = int(megatron.get("pipeline_model_parallel_size", 1)) * int(
        megatron.get("tensor_model_parallel_size", 1)
    )
    config = TrainerConfig(
        advantage_estimator="sft",
        megatron=megatron,
        megatron_optimizer={"lr": 1e-4},
        dp_size=world // parallel,
        dist_init_method=f"file://{out / 'rdzv'}",
        routing_replay=replay,
    )
    t = Trainer(config, resolve_model(model))
    rank = int(os.environ.get("RANK", "0"))
    batch = samples(t.arch if replay == "r3" else None)
    times, losses = [], []
    for _ in range(steps + 1):
        started = time.perf_counter()
        metrics = t.step(batch if rank == 0 else [])
        losses.append((metrics["train/nll"], metrics["train/grad_norm"]))
        times.append(time.perf_counter() - started)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"rank{rank}.json").write_text(
        json.dumps({"times": times[1:], "peak_mb": peak_mb, "loss": losses[0]})
    )


def run_layout(name: str, model: str, steps: int, tmp: Path, replay: str) -> dict:
    world, megatron = LAYOUTS[name]
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo"}
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [sys.executable, "-m", "bench.moe_step_time", "--worker", str(out), "--model", model,
            "--steps", str(steps), "--megatron", json.dumps(megatron), "--routing-replay", replay]  # fmt: skip
    procs = [
        subprocess.Popen(
            args,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=common.ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    for p in procs:
        log = p.communicate(timeout=900)[0]
        if p.returncode != 0:
            raise RuntimeError(f"layout {name} failed:\n{log[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "step s": statistics.median(ranks[0]["times"]),
        "peak MB": [r["peak_mb"] for r in ranks],
        "loss": ranks[0]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny-moe", help="MoE preset or directory (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (default: %(default)s)")
    ap.add_argument(
        "--layouts",
        default="1,ep2,pp2",
        help=f"comma-separated of {', '.join(LAYOUTS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--routing-replay",
        default="off",
        choices=["off", "r2", "r3"],
        help="trainer.routing_replay; r3 gives every sequence random routed experts (default: %(default)s)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--megatron", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)  # fmt: skip
    if args.worker:
        worker(Path(args.worker), args.model, json.loads(args.megatron), int(os.environ.get("WORLD_SIZE", "1")),
               args.steps, args.routing_replay)  # fmt: skip
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-moe-step-") as tmp:
        for name in common.csv(args.layouts):
            results[name] = run_layout(name, args.model, args.steps, Path(tmp), args.routing_replay)
            print(f"  {name}: {results[name]}", flush=True)
    base = results.get("1", {}).get("step s")
    base_loss = results.get("1", {}).get("loss")
    print(f"\n== {args.model}: trainer step (16 sequences, ~800 tokens), median of {args.steps}, routing_replay "
          f"{args.routing_replay}; uptime: {os.getloadavg()[0]:.2f} load")  # fmt: skip
    print(f"{'layout':10s} {'ranks':>5s} {'step s':>7s} {'vs 1':>6s} {'first nll':>11s} {'Δ vs 1':>8s} "
          f"{'grad norm':>10s} {'Δ vs 1':>8s}  peak MB per rank")  # fmt: skip
    for name, r in results.items():
        ratio = f"{r['step s'] / base:.2f}x" if base else "-"
        dloss = f"{abs(r['loss'][0] - base_loss[0]):.1e}" if base_loss is not None else "-"
        dnorm = f"{abs(r['loss'][1] - base_loss[1]):.1e}" if base_loss is not None else "-"
        peaks = ", ".join(f"{p:.0f}" for p in r["peak MB"])
        print(
            f"{name:10s} {len(r['peak MB']):5d} {r['step s']:7.3f} {ratio:>6s} {r['loss'][0]:11.6f} {dloss:>8s} "
            f"{r['loss'][1]:10.5f} {dnorm:>8s}  {peaks}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
