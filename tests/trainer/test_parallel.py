"""Data and tensor parallelism for real: two gloo processes (file rendezvous, loopback) vs one.

Each worker is a separate Python process started the way torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK). Rank 1 is handed no samples: rank 0's batch is broadcast. With DP = 2 the packed
micro-batches are split between the ranks (Karmarkar-Karp); with TP = 2 every weight is split
Megatron's way and logits/logprobs are computed vocab-parallel. Either way one optimizer step must
give the same logprobs, weights and metrics as a single process on the whole batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.packing import build_micro_batch

WORKER = textwrap.dedent(
    """
    import json, random, sys
    import torch
    from palaestra.sample import Sample
    from palaestra.trainer import Trainer, TrainerConfig
    from palaestra.trainer.packing import build_micro_batch

    def samples(arch=None):
        # 16 samples; given a MoE `arch`, each with random routed experts (routing_replay r3) in the
        # engine's layout: a row for every layer, for every position but the last
        rng = random.Random(11)
        result = []
        for i in range(16):
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 10))]
            s = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 4}", env="t", task_id="t",
                       tokens=prompt, prompt_len=len(prompt), reward=float(i % 3 == 0))
            n = rng.choice([6, 10, 40, 90])
            s.append([rng.randrange(3, 4000) for _ in range(n)], sampled=True, logprobs=[-8.3] * n)
            if arch is not None:
                g = torch.Generator().manual_seed(i)
                rows = [torch.randperm(arch.num_experts, generator=g)[:arch.moe_topk]
                        for _ in range((len(s.tokens) - 1) * arch.num_layers)]
                s.set_routing(torch.stack(rows).reshape(len(s.tokens) - 1, arch.num_layers, -1).numpy())
            result.append(s)
        return result

    CONFIG = dict(megatron_optimizer={"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0},
                  max_tokens_per_microbatch=128, kl={"coef": 0.05})

    if __name__ == "__main__":
        out, rdzv, megatron, model_dir = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
        extra = json.loads(sys.argv[5])  # more trainer options (trainer.lora)
        dp = 2 // (megatron.get("tensor_model_parallel_size", 1) * megatron.get("pipeline_model_parallel_size", 1))
        cfg = TrainerConfig(**{**CONFIG, **extra}, megatron=megatron, dist_init_method=rdzv, dp_size=dp)
        t = Trainer(cfg, model_dir)
        import torch.distributed as dist
        from palaestra.weights_format import read_safetensors
        rank = dist.get_rank()
        arch = t.arch if cfg.routing_replay == "r3" else None
        batch = samples(arch) if rank == 0 else []
        full = t._broadcast(batch)
        original = dict(read_safetensors(t.model_dir))
        loaded = t.hf_state()  # gathered over TP
        exact = set(loaded) == set(original) and all(torch.equal(loaded[k], original[k]) for k in loaded)
        logprobs = t.logprobs([build_micro_batch(full, range(len(full)))])[0]
        mbs, _ = t._schedule(full)
        metrics = t.step(batch)
        weights = {k: v.clone() for k, v in t.megatron_state().items()}
        adapter = {k: v.clone() for k, v in t.adapter_state().items()} if t.lora is not None else {}
        t.save(f"{out}/ckpt")  # resumed by the test in one process: a checkpoint fits any DP size
        # one sample for two DP ranks: rank 1 runs a dummy micro-batch and trains nothing
        lonely = t.step(samples(arch)[:1] if rank == 0 else [])
        after_lonely = {k: v.clone() for k, v in t.megatron_state().items()}
        json.dump({"metrics": metrics, "microbatches": len(mbs), "rows": sum(mb.num_rows for mb in mbs),
                   "world": dist.get_world_size(), "load_exact": exact,
                   "lonely_tokens": lonely["train/loss_tokens"], "lonely_expected": samples()[0].num_sampled,
                   "local_qkv_rows": t.gpt.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]},
                  open(f"{out}/rank{rank}.json", "w"))
        if rank == 0:
            torch.save({"weights": weights, "adapter": adapter, "logprobs": logprobs,
                        "after_lonely": after_lonely}, f"{out}/result.pt")
    """
)


def run_two_ranks(tmp_path, megatron: dict, model_dir, extra: dict | None = None) -> tuple[list[dict], dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    rdzv = f"file://{tmp_path / 'rdzv'}"
    args = [sys.executable, str(script), str(tmp_path), rdzv, json.dumps(megatron), str(model_dir),
            json.dumps(extra or {})]  # fmt: skip
    procs = [
        subprocess.Popen(
            args,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    return ranks, torch.load(tmp_path / "result.pt", weights_only=True)


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    """The same step in this process (world size 1): logprobs before, weights and metrics after."""
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    t = Trainer(TrainerConfig(**namespace["CONFIG"]), tiny_model_dir)
    samples = namespace["samples"]()
    start = t.megatron_state()
    start = {k: v.clone() for k, v in start.items()}
    logprobs = t.logprobs([build_micro_batch(samples, range(len(samples)))])[0]
    metrics = t.step(samples)
    return {"start": start, "logprobs": logprobs, "metrics": metrics, "weights": t.megatron_state()}


def compare(ranks: list[dict], result: dict, single: dict, label: str) -> None:
    diff = max((result["weights"][k] - v).abs().max().item() for k, v in single["weights"].items())
    moved = max((result["weights"][k] - v).abs().max().item() for k, v in single["start"].items())
    lp = (result["logprobs"] - single["logprobs"]).abs().max().item()
    print(f"\n{label} vs 1 process: max |Δlogprob| = {lp:.2e}, max |Δw| after the step = {diff:.2e} "
          f"(the step moved weights by up to {moved:.2e})")  # fmt: skip
    assert lp <= 2e-6
    assert moved > 1e-3 and diff <= 1e-6
    for key in ("train/loss", "train/kl", "train/entropy", "train/loss_tokens"):
        for r in ranks:
            assert r["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-7), key
    # Megatron's grad norm (its torch fallback of multi_tensor_l2norm, without Apex) accumulates
    # squares of ~3 M gradients in float32; split over ranks the sums round differently, by a
    # few 1e-5 relative (a float64 sum of the same gradients lands between the two).
    for r in ranks:
        assert r["metrics"]["train/grad_norm"] == pytest.approx(
            single["metrics"]["train/grad_norm"], rel=1e-4
        )


@pytest.mark.slow
def test_two_data_parallel_ranks_match_one_process(tmp_path, single, tiny_model_dir):
    ranks, result = run_two_ranks(tmp_path, {}, tiny_model_dir)
    print(f"micro-batches per DP rank: {[r['microbatches'] for r in ranks]}")
    assert all(r["microbatches"] >= 1 and r["rows"] > 0 for r in ranks)  # both ranks did real work
    compare(ranks, result, single, "DP=2")
    assert all(r["lonely_tokens"] == r["lonely_expected"] for r in ranks)
    # the DP=2 checkpoint resumed in one process (DP=1): same weights, and the next step lands
    # where the two ranks' next step landed
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    resumed = Trainer(TrainerConfig(**namespace["CONFIG"]), tiny_model_dir)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step_count == 1 and resumed.weight_version == 1
    assert all(torch.equal(resumed.megatron_state()[k], v) for k, v in result["weights"].items())
    resumed.step(namespace["samples"]()[:1])
    diff = max(
        (resumed.megatron_state()[k] - v).abs().max().item() for k, v in result["after_lonely"].items()
    )
    print(f"resumed at DP=1 from a DP=2 checkpoint: next step max |Δw| vs DP=2 = {diff:.2e}")
    assert diff <= 1e-6


@pytest.mark.slow
def test_two_tensor_parallel_ranks_match_one_process(tmp_path, single, tiny_model_dir):
    ranks, result = run_two_ranks(tmp_path, {"tensor_model_parallel_size": 2}, tiny_model_dir)
    assert all(r["load_exact"] for r in ranks)  # HF -> shard -> gather -> HF is bit-exact
    assert all(r["local_qkv_rows"] == 512 // 2 for r in ranks)  # each rank holds one KV group
    assert ranks[0]["microbatches"] == ranks[1]["microbatches"]  # TP ranks share the data
    compare(ranks, result, single, "TP=2")


@pytest.mark.slow
def test_lora_with_two_tensor_parallel_ranks_matches_one_process(tmp_path, tiny_model_dir):
    """LoRA's factors split or replicated by each projection's TP layout (trainer/lora.py): the same
    logprobs, adapters after a step and metrics as one process; its checkpoint holds the whole factors."""
    lora = {"lora": {"rank": 8, "alpha": 16.0}}
    namespace: dict = {}
    exec(compile(WORKER.split("if __name__")[0], "worker", "exec"), namespace)
    t = Trainer(TrainerConfig(**namespace["CONFIG"], **lora), tiny_model_dir)
    batch = namespace["samples"]()
    start = {k: v.clone() for k, v in t.adapter_state().items()}
    single_lp = t.logprobs([build_micro_batch(batch, range(len(batch)))])[0]
    single_metrics = t.step(batch)
    single_adapter = t.adapter_state()

    ranks, result = run_two_ranks(tmp_path, {"tensor_model_parallel_size": 2}, tiny_model_dir, lora)
    assert all(r["load_exact"] for r in ranks)
    assert all(torch.equal(result["weights"][k], v) for k, v in t.megatron_state().items())  # base frozen
    lp = (result["logprobs"] - single_lp).abs().max().item()
    diff = max((result["adapter"][k] - v).abs().max().item() for k, v in single_adapter.items())
    moved = max((single_adapter[k] - v).abs().max().item() for k, v in start.items())
    print(f"\nLoRA TP=2 vs 1 process: max |Δlogprob| {lp:.2e}, max |Δadapter| after the step {diff:.2e} "
          f"(the step moved the adapters by up to {moved:.2e})")  # fmt: skip
    assert lp <= 2e-6 and moved > 1e-3 and diff <= 1e-6
    for key in ("train/loss", "train/kl", "train/loss_tokens"):
        for r in ranks:
            assert r["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-5, abs=1e-7), key
    for r in ranks:  # replicated factors counted once in the norm, split ones summed over ranks
        assert r["metrics"]["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-4)
    saved = torch.load(tmp_path / "ckpt" / "adapter.pt", weights_only=True)  # whole factors, gathered over TP
    assert set(saved) == set(single_adapter) and all(
        torch.equal(saved[k], v) for k, v in result["adapter"].items()
    )
    with pytest.raises(ValueError, match="tensor_model_parallel_size 2"):  # Adam's moments are per TP shard
        t.load(tmp_path / "ckpt")
