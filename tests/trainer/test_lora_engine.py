"""LoRA between the trainer and a real embedded engine (`palaestra engine serve --enable-lora`).

Adapter-only weight sync (unload + load + version in one pause: a few hundred KB instead of the
model), the trainer-vs-engine logprob check with the adapter on — rollouts sampled by the engine
through the adapter, recomputed by the trainer — the adapter named through the real sglang-router
by the gateway's engine client, and an engine started without LoRA refused at the trainer's start
with the flag to add.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from palaestra.engine.cli import engine_process
from palaestra.engine.router import RouterProcess
from palaestra.gateway.engine_client import EngineClient
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.packing import build_micro_batch
from palaestra.trainer.weight_sync import WeightSyncError
from tests.trainer.test_engine import rollouts
from tests.trainer.test_lora import samples

LORA = {"rank": 8, "alpha": 16.0}
pytestmark = pytest.mark.engine  # every test talks to an embedded engine process


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    with engine_process("tiny", extra_args=["--num-threads", "1", "--enable-lora"]) as proc:
        yield proc


@pytest.mark.slow
def test_adapter_sync_and_engine_logprobs_match_the_trainer(lora_engine, tiny_model_dir, tmp_path):
    cfg = TrainerConfig(lora=LORA, megatron_optimizer={"lr": 2e-2}, sync_dir=str(tmp_path / "shm"))
    t = Trainer(cfg, tiny_model_dir, engine_urls=[lora_engine.url])
    first = t.sync_weights()  # the start adapter (B = 0)
    with httpx.Client(base_url=lora_engine.url, timeout=120, trust_env=False) as c:
        assert c.get("/server_info").json()["loaded_lora_adapters"] == {
            "policy": str(tmp_path / "shm" / "policy-v0")
        }
        for version in (1, 2):
            metrics = t.step(samples(seed=version))  # one step, then the adapter-only sync
            assert c.get("/get_weight_version").json()["weight_version"] == str(version)
            assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == [f"policy-v{version}"]
        adapter_bytes = sum(p.numel() * p.element_size() for p in t.lora.parameters())
        print(f"\nsync: {adapter_bytes / 1e3:.0f} kB of adapters, {metrics['perf/sync_s'] * 1e3:.0f} ms, "
              f"engines paused {metrics['perf/sync_pause_s'] * 1e3:.0f} ms (first {first['perf/sync_s'] * 1e3:.0f} ms)")  # fmt: skip
        assert metrics["perf/sync_gb_per_s"] * metrics["perf/sync_s"] * 1e9 == pytest.approx(adapter_bytes)
        # rollouts through the adapter: the trainer recomputes exactly what the engine sampled
        batch = rollouts(_LoraClient(c), 8, 1.0, seed=4)
        assert all(s.weight_versions[-1] == "2" for s in batch)
        mbs = [build_micro_batch(batch, range(len(batch)))]
        delta = (t.logprobs(mbs)[0] - mbs[0].rollout_logprobs).abs()
        with t.lora.disabled():
            off = (t.logprobs(mbs)[0] - mbs[0].rollout_logprobs).abs().max().item()
        print(f"adapter on: {delta.numel()} tokens, mean |Δ| {delta.mean():.2e}, max |Δ| {delta.max():.2e} "
              f"(adapter off in the trainer: {off:.2e})")  # fmt: skip
        assert (
            delta.mean() <= 1e-6 and delta.max() <= 2e-6
        )  # one ulp of the largest logprobs, as without LoRA
        assert off > 1e-2  # the engine did sample with the adapter
        assert not c.get("/server_info").json()["internal_states"][0]["paused"]
    t.sync.close()


def test_the_gateway_names_the_adapter_through_the_router(lora_engine, tiny_model_dir, tmp_path):
    t = Trainer(TrainerConfig(lora=LORA, megatron_optimizer={"lr": 2e-2}), tiny_model_dir)
    t.step(samples(seed=3))
    path = t.export_adapter(tmp_path / "named")
    with httpx.Client(base_url=lora_engine.url, timeout=60, trust_env=False) as c:
        c.post("/unload_lora_adapter", json={"lora_name": "named"})
        assert (
            c.post("/load_lora_adapter", json={"lora_name": "named", "lora_path": str(path)}).status_code
            == 200
        )
    prompt = [11, 12, 13, 14, 15, 16]
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def both(url: str):
        named, plain = EngineClient(url, lora_adapter="named"), EngineClient(url)
        try:
            return (await named.generate("s1", prompt, sampling))[0], (
                await plain.generate("s1", prompt, sampling)
            )[0]
        finally:
            await named.close()
            await plain.close()

    with RouterProcess(
        [lora_engine.url], router_options=["--router-health-check-interval-secs", "1"]
    ) as router:
        via_router, base = asyncio.run(both(router.url))
    direct, _ = asyncio.run(both(lora_engine.url))
    assert via_router.output_ids == direct.output_ids  # sglang-router 0.3.2 passes lora_path on
    assert via_router.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert via_router.logprobs != pytest.approx(base.logprobs, abs=1e-3)  # and it is not the base model


def test_an_engine_without_lora_is_refused_at_start_with_the_flag(engine, tiny_model_dir):
    with pytest.raises(
        WeightSyncError, match=r"serves without LoRA support.*palaestra engine serve --enable-lora"
    ):
        Trainer(TrainerConfig(lora=LORA), tiny_model_dir, engine_urls=[engine.url])


class _LoraClient:
    """`httpx.Client` whose /generate names the adapter (what the gateway's engine client does)."""

    def __init__(self, client: httpx.Client):
        self.client = client

    def post(self, path: str, json: dict):
        return self.client.post(path, json={**json, "lora_path": "policy"})


def test_scores_without_lora_path_are_the_base_models(lora_engine, tiny_model_dir):
    """Scoring (max_new_tokens 0) without lora_path: the base model, whatever adapters are resident."""
    t = Trainer(TrainerConfig(lora=LORA), tiny_model_dir)
    batch = samples(seed=9)[:2]
    with httpx.Client(base_url=lora_engine.url, timeout=60, trust_env=False) as c:
        for s in batch:
            body = {"input_ids": s.tokens, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                    "logprob_start_len": 0}  # fmt: skip
            got = torch.tensor(
                [e[0] for e in c.post("/generate", json=body).json()["meta_info"]["input_token_logprobs"]][
                    s.prompt_len :
                ]
            )
            with t.lora.disabled():
                want = t.logprobs([build_micro_batch([s], [0])], temperature=1.0)[0]
            assert (got - want).abs().max() <= 2e-6
