"""GPU readiness: run this first on a GPU host. One table, one verdict; no network needed.

    .venv/bin/python -m bench.gpu_check            # or: make gpu-check
    .venv/bin/python -m bench.gpu_check --cpu      # the same checks on CPU (gloo), to try the script

Checks, in order (a failed check marks the ones that need it as skipped, with the reason):

1. torch is a CUDA build, sees at least one GPU, and NCCL is available.
2. The trainer (megatron-core) runs a few optimizer steps of the `tiny` preset with TP = 1 and
   DP = the number of GPUs, one process per GPU over NCCL (gloo with --cpu, DP = 2): every rank
   reports the same finite loss, and the loss goes down on the repeated batch.
3. Logprob agreement: the trainer on the GPU against the embedded engine (which runs on CPU) on
   the same sampled tokens — max and mean |Δ logprob|. A large gap means the trainer and the
   engine do not compute the same model (TF32 matmuls, a wrong conversion, ...).
4. Weight sync: the trainer pushes its whole model to the embedded engine through the shm path
   (`sync.mode: shm`); bandwidth as a fraction of a memcpy of the same bytes, and the pause.
5. Mixture of experts: the same steps on the `tiny-moe` preset with expert parallelism over the
   ranks (EP = DP, Megatron's all-to-all dispatcher over NCCL; gloo with --cpu).

Context parallelism is not checked: the trainer refuses it on every device (its attention is
Megatron's local spec with packed sequences, and context parallelism needs TransformerEngine's).

The `tiny` preset builds offline (local tokenizer, random weights), so nothing is downloaded.
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench import common

STEPS_CONFIG = dict(megatron_optimizer={"optimizer": "adam", "lr": 1e-3}, max_tokens_per_microbatch=512)


def batch(vocab: int, n: int = 16, seed: int = 5) -> list:
    from palaestra.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
        s = Sample(sample_id=f"g{i}", session_id=f"g{i}", group_id=f"grp{i // 4}", env="gpu-check", task_id="t",
                   tokens=prompt, prompt_len=len(prompt), reward=float(i % 2))  # fmt: skip
        resp = [rng.randrange(3, vocab) for _ in range(rng.choice([8, 24, 64]))]
        s.append(resp, sampled=True, logprobs=[-8.0] * len(resp))
        out.append(s)
    return out


def dist_size() -> int:
    """DP replicas of a worker: every rank is one (TP = 1)."""
    return int(os.environ["WORLD_SIZE"])


def worker(out: Path, steps: int, model: str = "tiny", megatron: dict | None = None) -> None:
    """One trainer rank (RANK/WORLD_SIZE/LOCAL_RANK set by the parent): a few steps, then a JSON line."""
    import torch.distributed as dist

    from palaestra.models import resolve_model
    from palaestra.trainer import Trainer, TrainerConfig

    rdzv = f"file://{out / 'rdzv'}"
    config = TrainerConfig(
        **STEPS_CONFIG,
        advantage_estimator="sft",
        dist_init_method=rdzv,
        dp_size=dist_size(),
        megatron=megatron or {},
    )
    t = Trainer(config, resolve_model(model))
    samples = batch(t.arch.vocab_size)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(t.step(samples if dist.get_rank() == 0 else [])["train/nll"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "losses": losses,
              "step_s": min(seconds), "backend": dist.get_backend(),
              "device": str(next(t.gpt.parameters()).device)}  # fmt: skip
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


WORKER_ARGV = [sys.executable, "-m", "bench.gpu_check"]
"""How a trainer rank starts: as the module, from the repository root (`bench` is a package there)."""


def run_ranks(
    world: int, steps: int, cpu: bool, model: str = "tiny", megatron: dict | None = None
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        if cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["GLOO_SOCKET_IFNAME"] = "lo"
        args = [*WORKER_ARGV, "--worker", tmp, "--steps", str(steps), "--model", model,
                "--megatron", json.dumps(megatron or {})]  # fmt: skip
        procs = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=common.ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]  # fmt: skip
        logs = [p.communicate(timeout=900)[0] for p in procs]
        for p, log in zip(procs, logs, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"a trainer rank exited with {p.returncode}:\n{log[-2000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def trainer_row(table: Table, label: str, run: Any) -> None:
    """One table row from `run()`'s ranks: the same finite NLL on every rank, going down."""
    try:
        ranks = run()
        losses = [r["losses"] for r in ranks]
        same = all(max(abs(a - b) for a, b in zip(ls, losses[0], strict=True)) <= 1e-5 for ls in losses)
        finite = all(math.isfinite(x) for ls in losses for x in ls)
        down = losses[0][-1] < losses[0][0]
        table.add(f"{label} ({ranks[0]['backend']})", same and finite and down,
                  f"nll {' -> '.join(f'{x:.4f}' for x in losses[0])} on {ranks[0]['device']}, "
                  f"same on every rank: {same}; {min(r['step_s'] for r in ranks) * 1e3:.0f} ms/step")  # fmt: skip
    except Exception as exc:
        table.add(label, False, f"{type(exc).__name__}: {str(exc)[:300]}")


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        self.rows.append((check, {True: "PASS", False: "FAIL", None: "SKIP"}[ok], detail))

    def print(self) -> None:
        w = max(len(r[0]) for r in self.rows)
        print(f"\n{'check':{w}}  result  detail\n{'-' * w}  ------  {'-' * 60}")
        for check, result, detail in self.rows:
            print(f"{check:{w}}  {result:6}  {detail}")

    @property
    def ok(self) -> bool:
        return all(r[1] == "PASS" for r in self.rows)


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--cpu", action="store_true", help="run the checks on CPU (gloo, DP = 2)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer rank")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    ap.add_argument("--megatron", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker), args.steps, args.model, json.loads(args.megatron))
        return 0

    if args.cpu:  # before the first CUDA call, so that this process and its ranks see no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    table = Table()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if args.cpu:
        table.add("torch build", None, f"torch {torch.__version__}; --cpu: GPU checks replaced by CPU ones")
        world = 2
    else:
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)})) if gpus else "none"
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        table.add("torch CUDA build", torch.version.cuda is not None,
                  f"torch {torch.__version__}, CUDA {torch.version.cuda or 'absent: a CPU-only wheel'}")  # fmt: skip
        table.add("GPUs visible", gpus > 0, f"{gpus} x {names}")
        table.add("NCCL", bool(nccl), "available" if nccl else "torch.distributed has no NCCL")
        world = gpus
    ready = args.cpu or table.ok

    # -- trainer steps over DP ranks, then the same on a MoE with expert parallelism over them ------
    ep = world if world in (1, 2, 4, 8) else 1  # tiny-moe has 8 experts
    for model, megatron, label, unready in (
        ("tiny", {}, f"trainer: tiny, TP=1, DP={world}", "trainer: tiny, TP=1, DP=#GPUs"),
        ("tiny-moe", {"expert_model_parallel_size": ep}, f"trainer: tiny-moe, EP={ep}, DP={world}",
         "trainer: tiny-moe, EP=DP=#GPUs"),
    ):  # fmt: skip
        if ready:
            trainer_row(
                table, label, lambda m=model, mg=megatron: run_ranks(world, args.steps, args.cpu, m, mg)
            )
        else:
            table.add(unready, None, "skipped: no usable CUDA/NCCL")

    # -- logprobs against the embedded engine, and weight sync -----------------------------------
    if ready:
        try:
            agreement_and_sync(table)
        except Exception as exc:
            traceback.print_exc()
            table.add("trainer vs engine / weight sync", False, f"{type(exc).__name__}: {str(exc)[:300]}")
    else:
        table.add("logprobs: trainer vs engine", None, "skipped: no usable CUDA")
        table.add("weight sync (shm)", None, "skipped: no usable CUDA")

    table.print()
    if args.cpu:
        verdict = "CPU dry run " + ("passed" if all(r[1] != "FAIL" for r in table.rows) else "FAILED")
        print(f"\nverdict: {verdict} (this says nothing about a GPU; run without --cpu on the GPU host)")
        return 0 if all(r[1] != "FAIL" for r in table.rows) else 1
    print(
        f"\nverdict: {'READY: this host can train on its GPUs' if table.ok else 'NOT READY: see FAIL/SKIP rows'}"
    )
    return 0 if table.ok else 1


def agreement_and_sync(table: Table) -> None:
    import httpx

    from palaestra.engine.cli import engine_process
    from palaestra.models import resolve_model
    from palaestra.trainer import Trainer, TrainerConfig
    from palaestra.trainer.packing import build_micro_batch
    from palaestra.trainer.weight_sync import WeightSync

    trainer = Trainer(TrainerConfig(**STEPS_CONFIG), resolve_model("tiny"))
    samples = batch(trainer.arch.vocab_size, n=8, seed=9)
    mine = trainer.logprobs([build_micro_batch(samples, range(len(samples)))])[0]
    with engine_process("tiny", extra_args=["--num-threads", "2"]) as engine:
        theirs = []
        with httpx.Client(base_url=engine.url, timeout=120, trust_env=False) as client:
            for s in samples:
                r = client.post("/generate", json={"input_ids": s.tokens, "sampling_params": {"max_new_tokens": 0},
                                                   "return_logprob": True, "logprob_start_len": 0})  # fmt: skip
                r.raise_for_status()
                theirs.extend(x[0] for x in r.json()["meta_info"]["input_token_logprobs"][s.prompt_len :])
        delta = (mine - torch.tensor(theirs)).abs()
        device = next(trainer.gpt.parameters()).device
        table.add(f"logprobs: trainer ({device.type}) vs engine (cpu)", float(delta.max()) <= 1e-2,
                  f"max |Δ| = {float(delta.max()):.2e}, mean {float(delta.mean()):.2e} over {delta.numel()} "
                  f"tokens (goal: max <= 1e-2)")  # fmt: skip

        named = list(trainer.hf_state().items())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        with WeightSync([engine.url], mode="shm") as sync:
            sync.push(named, "warmup")
            reports = [sync.push(named, f"check-{i}") for i in range(3)]
        src = torch.empty(nbytes // 4).uniform_()
        dst = torch.empty_like(src)
        copies = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        best = min(reports, key=lambda r: r.seconds)
        ratio = min(copies) / best.seconds
        table.add("weight sync (shm, 1 engine)", True,
                  f"{nbytes / 1e6:.1f} MB in {best.seconds * 1e3:.1f} ms = {nbytes / best.seconds / 1e9:.2f} GB/s "
                  f"({ratio:.3f} of memcpy), engine paused {best.pause_seconds * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
