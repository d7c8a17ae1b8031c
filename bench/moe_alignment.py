"""MoE train–inference alignment: the trainer's logprobs of engine samples, own routing vs the engine's (r3).

    .venv/bin/python -m bench.moe_alignment                  # tiny-moe, 16 samples, 3 updates
    .venv/bin/python -m bench.moe_alignment --model tiny-glm-moe --samples 32 --updates 5

Starts one embedded engine (`palaestra engine serve --enable-return-routed-experts`) and samples
the math demo's prompts from it over HTTP with ``return_routed_experts`` (temperature 1). A
`Trainer` with ``routing_replay="r3"`` then scores the exact sampled ids twice: with its own
routing (the routers choose, as with replay off) and with the engine's routing set on each Sample
(`Sample.set_routing`, what r3 replays). Printed per weight version: mean and max
|logprob_train − logprob_engine| over the sampled tokens, and the fraction of positions (those the
engine reports routing for) where the trainer's own top-k differs from the engine's in at least
one layer. Version 0 is the preset's weights; then the trainer takes `--updates` SFT steps on the
samples (with r3), pushes its weights to the engine (`/update_weights_from_tensor`, the full
state under HF names) and the measurement repeats on a fresh batch. Goal with r3: mean <= 1e-6.
"""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import torch

from bench import common

GOAL = 1e-6


def sample_batch(client: httpx.Client, tokenizer, prompts: list[list[int]], max_tokens: int, seed: int):
    """One batched /generate: Samples with the engine's logprobs, and its routing [n, layers, k]."""
    from palaestra.sample import Sample

    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_tokens, "sampling_seed": seed},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    r = client.post("/generate", json=body)
    r.raise_for_status()
    samples, routings = [], []
    for i, (prompt, answer) in enumerate(zip(prompts, r.json(), strict=True)):
        meta = answer["meta_info"]
        s = Sample(
            sample_id=f"s{seed}-{i}", session_id=f"s{seed}-{i}", group_id=f"g{seed}", env="math",
            task_id=str(i), tokens=list(prompt), prompt_len=len(prompt),
        )  # fmt: skip
        s.append(
            answer["output_ids"], sampled=True, logprobs=[lp for lp, *_ in meta["output_token_logprobs"]]
        )
        raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").copy()
        routings.append(raw.reshape(len(s.tokens) - 1, -1))  # [n, layers * k]
        samples.append(s)
    return samples, routings


def measure(trainer, samples, routings) -> dict[str, float]:
    """Own routing vs r3 (the engine's), on one micro-batch of `samples`."""
    from palaestra.trainer import moe
    from palaestra.trainer.packing import build_micro_batch

    k = trainer.arch.moe_topk
    for s, routing in zip(samples, routings, strict=True):
        s.set_routing(routing.reshape(routing.shape[0], -1, k))
    mb = build_micro_batch(samples, range(len(samples)))
    engine = mb.rollout_logprobs
    with trainer.replay.active("record"):
        own = trainer.logprobs([mb])[0]
    recorded = torch.stack(mb.routing, dim=1).sort(-1).values  # [T, MoE layers, k]
    mb.routing = moe.rollout_routing(samples, mb.sample_indices, trainer.arch)
    with trainer.replay.active("replay"):
        replayed = trainer.logprobs([mb])[0]
    differs, positions, start = 0, 0, 0
    for s, routing in zip(samples, routings, strict=True):
        rows = torch.as_tensor(routing.reshape(routing.shape[0], -1, k)).long()
        if rows.shape[1] == trainer.arch.num_layers:
            rows = rows[:, list(trainer.arch.moe_layers)]
        mine = recorded[start : start + rows.shape[0]]
        differs += int((mine != rows.sort(-1).values).any(-1).any(-1).sum())
        positions += rows.shape[0]
        start += len(s.tokens)
    own_diff, r3_diff = (own - engine).abs(), (replayed - engine).abs()
    return {
        "off_mean": own_diff.mean().item(), "off_max": own_diff.max().item(),
        "r3_mean": r3_diff.mean().item(), "r3_max": r3_diff.max().item(),
        "topk_differs": differs / positions, "tokens": float(len(engine)),
    }  # fmt: skip


def push_weights(client: httpx.Client, trainer) -> None:
    from palaestra.weights_format import serialize_named_tensors

    named = list(trainer.hf_state().items())
    r = client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(named)]}
    )
    r.raise_for_status()
    if not r.json().get("success"):
        raise RuntimeError(f"weight update refused: {r.text}")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny-moe", help="MoE preset or directory (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=16, help="sequences per batch (default: %(default)s)")
    ap.add_argument(
        "--max-tokens", type=int, default=16, help="tokens sampled per sequence (default: %(default)s)"
    )
    ap.add_argument(
        "--updates",
        type=int,
        default=3,
        help="trainer steps before the second measurement (default: %(default)s)",
    )
    ap.add_argument(
        "--lr", type=float, default=1e-3, help="Adam learning rate of the updates (default: %(default)s)"
    )
    args = ap.parse_args(argv)  # fmt: skip

    from transformers import AutoTokenizer

    from palaestra.engine.cli import engine_process
    from palaestra.environments.math.warmstart import _prompt_ids, demo_tasks
    from palaestra.models import resolve_model
    from palaestra.trainer import Trainer, TrainerConfig

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = TrainerConfig(
        advantage_estimator="sft", temperature=1.0, routing_replay="r3", megatron_optimizer={"lr": args.lr}
    )
    trainer = Trainer(config, model_dir)
    rows = []
    started = time.perf_counter()
    proc = engine_process(str(model_dir), extra_args=["--num-threads", "1", "--enable-return-routed-experts"])
    with proc, httpx.Client(base_url=proc.url, timeout=300, trust_env=False) as client:
        for version in (0, 1):
            tasks = demo_tasks(args.samples, seed=7000 + version)
            prompts = [_prompt_ids(tokenizer, t) for t in tasks]
            samples, routings = sample_batch(client, tokenizer, prompts, args.max_tokens, seed=version)
            rows.append((0 if version == 0 else args.updates, measure(trainer, samples, routings)))
            if version == 0:
                before = trainer.hf_state()
                for _ in range(args.updates):
                    trainer.step(samples)
                moved = max((v - before[k]).abs().max().item() for k, v in trainer.hf_state().items())
                push_weights(client, trainer)
    print(
        f"\n== {args.model}: |logprob_train - logprob_engine| per sampled token (fp32), {time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'updates':>7s} {'tokens':>6s} {'off mean':>9s} {'off max':>9s} {'r3 mean':>9s} {'r3 max':>9s} {'top-k differs':>13s}"
    )
    for updates, m in rows:
        print(
            f"{updates:7d} {int(m['tokens']):6d} {m['off_mean']:9.2e} {m['off_max']:9.2e} {m['r3_mean']:9.2e} "
            f"{m['r3_max']:9.2e} {m['topk_differs']:13.1%}"
        )
    print(f"(the {args.updates} updates moved the weights by up to {moved:.2e})")
    worst = max(m["r3_mean"] for _, m in rows)
    print(f"r3 mean {'meets' if worst <= GOAL else 'misses'} the {GOAL:.0e} goal (worst {worst:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
