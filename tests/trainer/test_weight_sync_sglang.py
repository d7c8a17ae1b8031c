"""SGLang's weight-update paths, end to end on this machine.

* distributed: two real embedded engines join a gloo broadcast group with this process as rank 0
  (`/init_weights_update_group`, `/update_weights_from_distributed`); every engine ends with the
  new weights (its logprobs change and equal a fresh engine loaded from the same weights) and the
  new version.
* ipc: `/update_weights_from_tensor` with torch-multiprocessing handles against a TEST DOUBLE of
  SGLang's endpoint (tests/support/fakes/sglang_weights.py, labelled as such): without a GPU the handles are
  shared-memory files instead of CUDA IPC handles; the double unpickles them in its own process as
  an SGLang TP worker would, and records what it received per TP rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from palaestra.net import free_port, wait_http_ok
from palaestra.trainer.weight_sync import WeightSync, WeightSyncError
from tests.support.listening import listening

FAKE = Path(__file__).parents[1] / "support" / "fakes" / "sglang_weights.py"


def perturbed(model_dir: Path, scale: float) -> list[tuple[str, torch.Tensor]]:
    state = load_file(str(next(model_dir.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(7)
    return [(k, v + scale * torch.randn(v.shape, generator=g) if "mlp" in k else v) for k, v in state.items()]


def score(url: str, ids: list[int]) -> list[float]:
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                   "return_logprob": True, "logprob_start_len": 0}, timeout=60, trust_env=False)  # fmt: skip
    r.raise_for_status()
    return [x[0] for x in r.json()["meta_info"]["input_token_logprobs"][1:]]


@pytest.fixture(scope="module")
def two_engines(engine):
    """The module's `engine` (tests/conftest.py, which test_bad_group_requests_are_named uses too)
    and one more: run in one process, the file starts two engines, not three."""
    from palaestra.engine.cli import engine_process

    with engine_process("tiny", extra_args=["--num-threads", "1"]) as other:
        yield [engine.url, other.url]


@pytest.mark.slow
@pytest.mark.engine
def test_distributed_broadcast_reaches_every_engine(two_engines, tiny_model_dir, tmp_path):
    ids = list(range(5, 60))
    before = [score(u, ids) for u in two_engines]
    named = perturbed(tiny_model_dir, 0.05)
    port = free_port()
    with WeightSync(two_engines, mode="distributed", bucket_mb=4, group_port=port) as sync:
        report = sync.push(named, "d-1")
        assert report.buckets > 1  # several broadcast rounds of one group
        # this process hosts the group's store: on the group address only, not torch's [::]
        assert {a for a, p in listening(os.getpid()) if p == port} == {"127.0.0.1"}
        for url in two_engines:
            assert httpx.get(f"{url}/model_info", trust_env=False).json()["weight_version"] == "d-1"
        after = [score(u, ids) for u in two_engines]
        # the same weights through the shm file path give the same logprobs: nothing was lost
        with WeightSync(two_engines[:1], mode="shm", disk_dir=tmp_path) as shm:
            shm.push(named, "check")
        reference = score(two_engines[0], ids)
        sync.push(named, "d-2")  # the group is kept between syncs
        assert httpx.get(f"{two_engines[1]}/model_info", trust_env=False).json()["weight_version"] == "d-2"
    for b, a in zip(before, after, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-3
    assert after[0] == after[1] == reference
    # the group was destroyed on close: a new update names the missing group
    r = httpx.post(f"{two_engines[0]}/update_weights_from_distributed", trust_env=False,
                   json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})  # fmt: skip
    assert r.status_code == 400 and "no weight update group" in r.json()["message"]


@pytest.mark.engine
def test_bad_group_requests_are_named(engine):
    post = lambda path, body: httpx.post(f"{engine.url}{path}", json=body, trust_env=False)  # noqa: E731
    r = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                             "world_size": 2, "backend": "gloo"})  # fmt: skip
    assert (
        r.status_code == 400 and "'rank_offset' must be between 1 and world_size - 1" in r.json()["message"]
    )
    r = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                             "world_size": 2})  # fmt: skip
    assert r.status_code == 400 and "backend 'nccl' needs CUDA" in r.json()["message"]
    r = post("/init_weights_update_group", {"master_port": 1})
    assert r.status_code == 400 and "'master_address' must be str" in r.json()["message"]
    r = post("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [[1]]})
    assert r.status_code == 400 and "one length" in r.json()["message"]
    assert httpx.get(f"{engine.url}/health", trust_env=False).status_code == 200  # still serving


def _alive(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"the fake SGLang server exited with {proc.returncode} before it listened")


@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory):
    """TEST DOUBLE of SGLang's weight endpoints with tp_size 2 (see tests/support/fakes/sglang_weights.py),
    one process for the module's tests (it imports torch: seconds each); each reads its own records."""
    port, record = free_port(), tmp_path_factory.mktemp("fake_sglang") / "record.jsonl"
    assert FAKE.is_file(), f"the fake SGLang server is not at {FAKE}"
    proc = subprocess.Popen([sys.executable, str(FAKE), str(port), str(record), "2"])
    try:
        # It imports torch first: on a loaded machine that alone can take tens of seconds, so the
        # wait is long and ends early only if the process died.
        wait_http_ok(f"http://127.0.0.1:{port}/server_info", timeout=180, abort=lambda: _alive(proc))
        yield f"http://127.0.0.1:{port}", record
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def file_system_sharing():
    """CPU tensors cross processes through named shared-memory files (what stands in for CUDA IPC)."""
    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(previous)


def test_ipc_mode_needs_cuda_or_shared_files(fake_sglang):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only hosts")
    with (
        WeightSync([fake_sglang[0]], mode="ipc", retries=1) as sync,
        pytest.raises(WeightSyncError, match="CUDA"),
    ):
        sync.push([("w", torch.ones(2))], "1")


def test_ipc_payload_contract_against_fake_sglang(fake_sglang, file_system_sharing):
    url, record = fake_sglang
    earlier = len(record.read_text().splitlines()) if record.exists() else 0  # the module's other tests'
    named = [("a.weight", torch.randn(4, 3)), ("b.weight", torch.randn(5)),
             ("c.weight", torch.randn(2, 2).to(torch.bfloat16))]  # fmt: skip
    with WeightSync([url], mode="ipc", bucket_mb=1) as sync:
        report = sync.push(named, "ipc-1")
    assert report.buckets == 2  # float32 and bfloat16 buckets: a flattened bucket has one dtype
    calls = [json.loads(line) for line in record.read_text().splitlines()[earlier:]]
    assert [c["load_format"] for c in calls] == ["flattened_bucket"] * 2
    assert all(c["paused"] for c in calls)  # applied between pause and continue
    assert [c["flush_cache"] for c in calls] == [False, True]  # only the last call flushes
    assert "weight_version" in calls[-1]["keys"] and "weight_version" not in calls[0]["keys"]
    expected = {n: [str(t.dtype), list(t.shape), float(t.double().sum())] for n, t in named}
    for c in calls:  # one entry per TP rank, each the same full tensors
        assert len(c["tensors"]) == 2 and c["tensors"][0] == c["tensors"][1]
    got = {k: v for c in calls for k, v in c["tensors"][0].items()}
    assert sorted(got) == sorted(expected)
    for name, (dtype, shape, total) in expected.items():
        assert got[name][:2] == [dtype, shape], name  # dtype kept: bf16 arrives as bf16
        assert got[name][2] == pytest.approx(total, rel=1e-6), name
    assert httpx.get(f"{url}/model_info", trust_env=False).json()["weight_version"] == "ipc-1"
