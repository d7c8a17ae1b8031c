"""LoRA in the Megatron trainer (`trainer.lora`), one process, the `tiny` preset.

What trains (the adapters only; the optimizer holds nothing else), what the frozen base is used
for (the reference with no snapshot, teachers and `ref` with the adapters off, the previous step's
adapters for one-step-off), checkpoints (adapters + optimizer state, refused onto another base),
the exports (PEFT's layout that `peft` loads with the same logprobs; a merged HF model from a
checkpoint by `palaestra export`), the config's refusals, and an engine that cannot take the
adapter refused at start with the flag to add. Through the whole stack (adapter-only sync, the
trainer-vs-engine logprob check with the adapter on): tests/orchestrator/test_train_e2e.py.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from palaestra.sample import Sample
from palaestra.trainer import Trainer, TrainerConfig
from palaestra.trainer.config import KlOptions, OpdOptions, SyncOptions
from palaestra.trainer.lora import LoraOptions
from palaestra.trainer.packing import build_micro_batch

LORA = {"rank": 8, "alpha": 16.0}
OPT = {"lr": 2e-2}


def samples(n: int = 8, seed: int = 11) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 10))]
        s = Sample(sample_id=f"s{seed}-{i}", session_id=f"s{seed}-{i}", group_id=f"g{i // 4}", env="t",
                   task_id="t", tokens=prompt, prompt_len=len(prompt), reward=float(i % 3 == 0))  # fmt: skip
        n_out = rng.choice([6, 10, 30])
        s.append([rng.randrange(3, 4000) for _ in range(n_out)], sampled=True, logprobs=[-8.3] * n_out)
        out.append(s)
    return out


def logprobs(t: Trainer, batch: list[Sample], tag: str = "actor") -> torch.Tensor:
    return t.logprobs([build_micro_batch(batch, range(len(batch)))], tag=tag)[0]


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A LoRA trainer (with a KL to the reference and the old adapters kept) before and after one step."""
    t = Trainer(
        TrainerConfig(lora=LORA, keep_old_actor=True, megatron_optimizer=OPT, kl=KlOptions(coef=0.1)),
        tiny_model_dir,
    )
    batch = samples()
    with t.lora.disabled():
        base = logprobs(t, batch)
    before = logprobs(t, batch)
    start_base = {k: v.clone() for k, v in t.megatron_state().items()}
    metrics = t.step(batch)
    return {
        "t": t,
        "batch": batch,
        "base": base,
        "before": before,
        "start_base": start_base,
        "metrics": metrics,
    }


def test_only_the_adapters_train(trained):
    t = trained["t"]
    trainable = [n for n, p in t.gpt.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
    assert len(trainable) == 4 * 7 * 2  # 4 layers x 7 projections x (A, B)
    in_optimizer = sum(p.numel() for g in t.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in t.lora.parameters())
    assert torch.equal(trained["before"], trained["base"])  # B = 0: the adapted model is the base model
    assert trained["metrics"]["train/grad_norm"] > 0
    assert all(torch.equal(v, trained["start_base"][k]) for k, v in t.megatron_state().items())  # base frozen
    after = logprobs(t, trained["batch"])
    assert (after - trained["before"]).abs().max() > 1e-2  # the adapters learned


def test_the_reference_is_the_base_with_the_adapters_off(trained):
    t = trained["t"]
    assert t.snapshots.tags == ["actor"] and t.snapshots.host_bytes == 0  # no `ref` copy of the weights
    assert torch.equal(logprobs(t, trained["batch"], "ref"), trained["base"])
    assert trained["metrics"]["train/kl"] == 0.0  # the first step starts at the reference
    # one-step-off: "old_actor" is the adapters as they were before the last step
    assert torch.equal(logprobs(t, trained["batch"], "old_actor"), trained["before"])
    assert not torch.equal(logprobs(t, trained["batch"]), trained["before"])  # and the live ones are back


def test_a_megatron_teacher_scores_with_the_adapters_off(tiny_model_dir, trained):
    cfg = TrainerConfig(lora=LORA, megatron_optimizer=OPT,
                        opd=OpdOptions(kl_coef=1.0, teacher_mode="megatron", teacher_model=str(tiny_model_dir)))  # fmt: skip
    t = Trainer(cfg, tiny_model_dir)
    t.step(trained["batch"])
    from palaestra.trainer.opd_panel import snapshot_tag

    teacher = logprobs(t, trained["batch"], snapshot_tag("teacher"))
    assert torch.equal(
        teacher, trained["base"]
    )  # the teacher (= the base here) without the student's adapters
    assert not torch.equal(logprobs(t, trained["batch"]), trained["base"])


def test_checkpoint_resumes_adapters_and_optimizer_state(tiny_model_dir, trained, tmp_path):
    cfg = TrainerConfig(lora=LORA, keep_old_actor=True, megatron_optimizer=OPT, kl=KlOptions(coef=0.1))
    t = trained["t"]
    t.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter.pt").is_file() and not (tmp_path / "ckpt" / "model.pt").exists()
    resumed = Trainer(cfg, tiny_model_dir)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step_count == 1 and resumed.weight_version == 1
    state = t.adapter_state()
    assert all(torch.equal(v, state[k]) for k, v in resumed.adapter_state().items())
    assert torch.equal(logprobs(resumed, trained["batch"], "old_actor"), trained["before"])
    nxt = samples(seed=5)
    a, b = t.step(nxt), resumed.step(nxt)  # Adam's moments came back too: the same second step
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
    assert (
        max((v - resumed.adapter_state()[k]).abs().max().item() for k, v in t.adapter_state().items()) <= 1e-7
    )
    # refused: a full fine-tuning trainer, and a LoRA trainer of another base model
    with pytest.raises(ValueError, match="LoRA adapters"):
        Trainer(TrainerConfig(megatron_optimizer=OPT), tiny_model_dir).load(tmp_path / "ckpt")
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="another base model"):
        Trainer(cfg, other).load(tmp_path / "ckpt")


def test_peft_loads_the_export_with_the_same_logprobs(tiny_model_dir, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = trained["t"]
    path = t.export_adapter(tmp_path / "adapter")
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), path
    )
    model.eval()
    ours = logprobs(t, trained["batch"])
    theirs = []
    for s in trained["batch"]:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0].float(), -1)
        rows = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
        theirs.append(lp[rows, torch.tensor(s.tokens[s.prompt_len :])])
    delta = (torch.cat(theirs) - ours).abs().max().item()
    print(f"\npeft {type(model).__name__} vs the trainer: max |Δlogprob| {delta:.2e}")
    assert delta <= 1e-5
    # files another user or a container can read, naming the preset rather than this cache's path
    assert {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()} == {
        "adapter_config.json": 0o644,
        "adapter_model.safetensors": 0o644,
    }
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"


def test_palaestra_export_writes_the_adapter_and_a_merged_model(tiny_model_dir, trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from palaestra.cli import main
    from palaestra.weights_format import read_adapter

    t = trained["t"]
    t.save(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "peft")]) == 0
    files = read_adapter(tmp_path / "peft")
    assert files.rank == LORA["rank"] and files.base_checksum == t.base_checksum
    live = t.adapter_state()
    for module, (a, b) in files.weights.items():
        assert torch.equal(a, live[f"base_model.model.{module}.lora_A.weight"])
        assert torch.equal(b, live[f"base_model.model.{module}.lora_B.weight"])
    assert main(["export", str(tmp_path / "ckpt"), "--merged", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    s = trained["batch"][0]
    with torch.no_grad():
        lp = torch.log_softmax(merged(torch.tensor([s.tokens])).logits[0].float(), -1)
    rows = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
    got = lp[rows, torch.tensor(s.tokens[s.prompt_len :])]
    assert (got - logprobs(t, [s])).abs().max() <= 1e-5
    # the live trainer's merged export is the same model
    t.export_hf(tmp_path / "merged-live")
    from safetensors.torch import load_file

    a, b = (
        load_file(str(tmp_path / "merged" / "model.safetensors")),
        load_file(str(tmp_path / "merged-live" / "model.safetensors")),
    )
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)
    for out in ("peft", "merged", "merged-live"):
        modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / out).iterdir()}
        assert set(modes.values()) == {"0o644"}, (out, modes)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "tiny"
    )


def test_bad_options_name_what_to_change(tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"'qproj' is not a projection.*q_proj, k_proj, v_proj, o_proj, gate_proj"
    ):
        LoraOptions(rank=8, targets=["qproj"])
    with pytest.raises(ValueError, match="rank"):
        LoraOptions(rank=-1)
    with pytest.raises(ValueError, match="sync.mode must be shm"):
        TrainerConfig(lora={"rank": 8}, sync=SyncOptions(mode="distributed"))
    # tiny: k_proj is 128 x 256 (2 KV heads of 64)
    with pytest.raises(
        ValueError, match=r"lora.rank 200 is larger than k_proj's smaller dimension \(k_proj is 128 x 256\)"
    ):
        Trainer(TrainerConfig(lora={"rank": 200}), tiny_model_dir)
    assert LoraOptions(rank=4, targets=["linear_qkv", "down_proj"]).enabled
    from palaestra.trainer.lora import resolve_targets

    assert resolve_targets(["linear_qkv", "down_proj"]) == ("q_proj", "k_proj", "v_proj", "down_proj")


def test_an_engine_that_cannot_take_the_adapter_is_refused_with_the_flag(tiny_model_dir, tmp_path):
    """The check the trainer runs at start (trainer/lora_sync.py) against the embedded engine in
    this process: started without LoRA, or with a lower --max-lora-rank; and SGLang's answer."""
    import httpx
    from fastapi.testclient import TestClient

    from palaestra.engine.server import EngineConfig, EngineServer
    from palaestra.trainer.lora_sync import check_lora_support
    from palaestra.trainer.weight_sync import WeightSync, WeightSyncError

    url = "http://testserver"
    sync = WeightSync([url], mode="disk", disk_dir=tmp_path)
    for config, message in (
        ({}, r"serves without LoRA support.*palaestra engine serve --enable-lora"),
        (
            {"enable_lora": True, "max_lora_rank": 4},
            r"up to rank 4 \(--max-lora-rank\); trainer.lora.rank is 8",
        ),
    ):
        server = EngineServer(EngineConfig(model_path=str(tiny_model_dir), **config))
        try:
            with TestClient(server.app) as c, pytest.raises(WeightSyncError, match=message):
                check_lora_support(sync.engines, url, 8, ["q_proj", "v_proj"], client=c)
        finally:
            server.engine.shutdown()

    def sglang(request: httpx.Request) -> httpx.Response:
        """TEST DOUBLE: SGLang's /server_info of a server started without --enable-lora."""
        return httpx.Response(200, json={"enable_lora": False, "lora_paths": None, "max_lora_rank": None})

    with httpx.Client(transport=httpx.MockTransport(sglang)) as c:
        with pytest.raises(
            WeightSyncError, match=r"--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj"
        ):
            check_lora_support(sync.engines, url, 8, ["q_proj", "v_proj"], client=c)
    sync.close()


def test_an_adapter_sync_reads_and_checks_the_adapter_before_the_pause(trained, tmp_path, monkeypatch):
    """trainer/lora_sync.py against the embedded engine in this process: each version is loaded
    under its own name while the engine generates (read once, never while paused), the served name
    then holds the trainer's factors at the trainer's version and the staged name is gone; an
    adapter the engine refuses fails the sync before the engine pauses, the old version still served."""
    from fastapi.testclient import TestClient

    from palaestra.engine import lora_api
    from palaestra.engine.server import EngineConfig, EngineServer
    from palaestra.trainer.weight_sync import WeightSync, WeightSyncError
    from palaestra.weights_format import read_adapter

    t = trained["t"]
    server = EngineServer(EngineConfig(model_path=str(t.model_dir), enable_lora=True))
    reads = []

    def counted_read(path):  # the real read, noting whether the engine was paused
        reads.append(server.engine.paused)
        return read_adapter(path)

    monkeypatch.setattr(lora_api, "read_adapter", counted_read)
    sync = None
    try:
        with TestClient(server.app) as client:
            sync = WeightSync(["http://testserver"], mode="disk", disk_dir=tmp_path, client=client)
            adapter, config = t.adapter_state(), t.lora.peft_config(str(t.model_dir))
            for version in ("1", "2"):
                report = sync.push_adapter("policy", config, adapter, version, t.base_checksum)
                assert report.phases["stage_load"] > 0 and report.pause_seconds < report.seconds
                info = client.get("/server_info").json()
                assert info["weight_version"] == version and set(info["loaded_lora_adapters"]) == {"policy"}
            assert reads == [False, False]  # one read per sync, none inside the pause
            served = server.engine.lora.adapters["policy"]
            module, (a, b) = next(iter(served.weights.items()))
            assert torch.equal(a, adapter[f"base_model.model.{module}.lora_A.weight"].to(a.dtype))
            with pytest.raises(WeightSyncError, match="another base model"):
                sync.push_adapter("policy", config, adapter, "3", "0" * 32)
            assert not server.engine.paused and reads == [False, False, False]
            info = client.get("/server_info").json()
            assert info["weight_version"] == "2" and set(info["loaded_lora_adapters"]) == {"policy"}
    finally:
        if sync is not None:
            sync.close()
        server.engine.shutdown()
