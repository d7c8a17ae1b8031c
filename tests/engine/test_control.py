"""Abort, pause/continue, cache flush and weight updates of the embedded engine, over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import torch
from safetensors.torch import save_file

from palaestra.weights_format import serialize_named_tensors

pytestmark = pytest.mark.engine  # every test talks to the module's engine

PROMPT = [5, 77, 301, 12, 999, 45, 8, 1200]
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def greedy(client, n=12):
    r = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_running(client, count=1, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.get("/server_info").json()["internal_states"][0]
        if state["running"] >= count:
            return
        time.sleep(0.02)
    raise AssertionError("request never started running")


def test_abort_by_rid_prefix_returns_partial_output(client):
    with cf.ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                client.post,
                "/generate",
                json={
                    "input_ids": PROMPT,
                    "rid": f"job-7_{i}",
                    "sampling_params": LONG,
                    "return_logprob": True,
                },
            )
            for i in range(2)
        ]
        wait_running(client, 2)
        time.sleep(0.2)
        assert client.post("/abort_request", json={"rid": "job-7"}).status_code == 200
        answers = [f.result(timeout=30) for f in futs]
    for r in answers:
        assert r.status_code == 200  # an abort is a successful answer carrying the partial generation
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < 3000
        assert len(r.json()["output_ids"]) == len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert greedy(client, 2)["meta_info"]["completion_tokens"] == 2


def test_pause_in_place_blocks_new_requests_until_continue(client):
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            client.post,
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        )
        wait_running(client, 1)
        assert client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
        late = pool.submit(
            client.post, "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        )
        time.sleep(0.6)
        assert not running.done() and not late.done()  # both wait while paused
        assert client.get("/health").status_code == 200  # health stays cheap while paused
        assert client.post("/flush_cache").status_code == 400  # requests in flight
        assert client.post("/continue_generation", json={}).json()["status"] == "ok"
        first, second = running.result(timeout=60), late.result(timeout=60)
    assert first.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert second.json()["meta_info"]["completion_tokens"] == 3


def test_pause_abort_mode_aborts_in_flight(client):
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.post, "/generate", json={"input_ids": PROMPT, "sampling_params": LONG})
        wait_running(client, 1)
        assert client.post("/pause_generation", json={}).status_code == 200
        r = fut.result(timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    client.post("/continue_generation", json={})
    assert greedy(client, 2)["meta_info"]["completion_tokens"] == 2
    assert client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400


def _state_dict(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(next(tiny_model_dir.glob("*.safetensors"))))


def test_weight_update_from_disk_changes_outputs_and_version(client, tiny_model_dir, tmp_path):
    before = greedy(client)
    version0 = client.get("/get_weight_version").json()["weight_version"]
    original = _state_dict(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    changed = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) if "mlp" in k else v for k, v in original.items()
    }
    save_file(changed, str(tmp_path / "model.safetensors"))
    r = client.post(
        "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "step-1"}
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert client.get("/get_weight_version").json() == {"weight_version": "step-1"}
    assert client.get("/model_info").json()["weight_version"] == "step-1"
    after = greedy(client)
    assert after["meta_info"]["weight_version"] == "step-1"
    assert after["output_ids"] != before["output_ids"]
    # restoring the original weights restores the original outputs exactly
    r = client.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": version0}
    )
    assert r.json()["success"]
    assert greedy(client)["output_ids"] == before["output_ids"]


def test_weight_update_from_tensor_both_layouts(client, tiny_model_dir):
    before = greedy(client)
    original = _state_dict(tiny_model_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    bumped = [(name, original[name] * 3.0)]
    for flattened, version in ((False, "tensor-1"), (True, "tensor-2")):
        r = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [serialize_named_tensors(bumped, flattened=flattened)],
                "load_format": "flattened_bucket" if flattened else None,
                "weight_version": version,
            },
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        assert client.get("/get_weight_version").json()["weight_version"] == version
        assert greedy(client)["output_ids"] != before["output_ids"]
    r = client.post(
        "/update_weights_from_tensor",
        json={
            "serialized_named_tensors": [serialize_named_tensors([(name, original[name])])],
            "weight_version": "restored",
        },
    )
    assert r.json()["success"]
    assert greedy(client)["output_ids"] == before["output_ids"]


@pytest.mark.parametrize(
    "payload, needle",
    [
        ({"serialized_named_tensors": ["!!notbase64"]}, "cannot decode"),
        ({"serialized_named_tensors": "x"}, "one base64 string"),
        (
            {"serialized_named_tensors": [serialize_named_tensors([("model.nope.weight", torch.zeros(2))])]},
            "unknown parameter",
        ),
        (
            {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", torch.zeros(3))])]},
            "shape mismatch",
        ),
    ],
)
def test_bad_weight_updates_fail_cleanly(client, payload, needle):
    version = client.get("/get_weight_version").json()["weight_version"]
    before = greedy(client)
    r = client.post("/update_weights_from_tensor", json={**payload, "weight_version": "must-not-apply"})
    assert r.status_code == 400 and r.json()["success"] is False and needle in r.json()["message"]
    assert client.get("/get_weight_version").json()["weight_version"] == version
    assert greedy(client)["output_ids"] == before["output_ids"]  # nothing was half-applied


def test_bad_disk_update(client, tmp_path):
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["message"]
    assert client.post("/update_weights_from_disk", json={}).status_code == 400


def test_update_weight_version_and_span_tracking(client):
    r = client.post("/update_weight_version", json={"new_version": "v-explicit"})
    assert r.json() == {"success": True, "message": "Weight version updated.", "new_version": "v-explicit"}
    assert greedy(client, 2)["meta_info"]["weight_version"] == "v-explicit"
    # a version change while a request is paused in place is reported as spans over output tokens
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client.post,
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
        )
        wait_running(client, 1)
        client.post("/pause_generation", json={"mode": "in_place"})
        client.post("/update_weight_version", json={"new_version": "v-next", "abort_all_requests": False})
        client.post("/continue_generation", json={})
        meta = fut.result(timeout=60).json()["meta_info"]
    assert meta["weight_version"] == "v-next"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["v-explicit", "v-next"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 300


def test_weight_update_waits_for_running_requests(client, tiny_model_dir):
    """Not paused: the update takes effect only after in-flight requests finish (SGLang's writer lock)."""
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            client.post,
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
        )
        wait_running(client, 1)
        update = pool.submit(
            client.post,
            "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "after-drain"},
        )
        meta = running.result(timeout=60).json()["meta_info"]
        assert update.result(timeout=60).json()["success"]
    assert "weight_versions" not in meta and meta["weight_version"] != "after-drain"
    assert client.get("/get_weight_version").json()["weight_version"] == "after-drain"
