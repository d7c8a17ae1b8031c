"""Two real embedded engines behind the real sglang-router (consistent hashing on X-SMG-Routing-Key)."""

from __future__ import annotations

import httpx
import pytest

from palaestra.engine.cli import engine_process
from palaestra.engine.router import RouterProcess

pytestmark = pytest.mark.engine  # two embedded engines behind the router

COUNTER = "palaestra_engine_http_generate_requests_total"


def _count(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(COUNTER + " "):
            return float(line.split()[1])
    raise AssertionError(f"{COUNTER} missing from {url}/metrics")


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    with (
        engine_process("tiny", extra_args=["--num-threads", "1"]) as e1,
        engine_process("tiny", extra_args=["--num-threads", "1"]) as e2,
        RouterProcess(
            [e1.url, e2.url], router_options=["--router-health-check-interval-secs", "1"]
        ) as router,
    ):
        yield router, [e1, e2]


def test_each_routing_key_lands_on_one_worker(fleet):
    router, engines = fleet
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    placement: dict[str, int] = {}
    with httpx.Client(timeout=60, trust_env=False) as c:
        for k in range(50):
            key = f"session-{k}"
            before = [_count(c, e.url) for e in engines]
            for _ in range(5):
                r = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": key})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["completion_tokens"] == 1
            delta = [_count(c, e.url) - b for e, b in zip(engines, before, strict=True)]
            assert sorted(delta) == [0, 5], f"key {key} was split across workers: {delta}"
            placement[key] = delta.index(5)
        per_worker = [list(placement.values()).count(i) for i in range(2)]
        print(f"keys per worker: {per_worker}")
        assert min(per_worker) > 0, "consistent hashing should spread 50 keys over both workers"
        # no key: still served (by some worker)
        before = sum(_count(c, e.url) for e in engines)
        r = c.post(f"{router.url}/generate", json=body)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1
        assert sum(_count(c, e.url) for e in engines) == before + 1


def test_full_protocol_survives_the_router(fleet):
    """The router re-serialises /generate bodies; logprob fields must still come back intact."""
    router, _ = fleet
    body = {
        "input_ids": [5, 6, 7, 8],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
    }
    with httpx.Client(timeout=60, trust_env=False) as c:
        a = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": "k"}).json()
        b = c.post(f"{router.url}/generate", json=body, headers={"X-SMG-Routing-Key": "k"}).json()
    meta = a["meta_info"]
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 3
    assert len(meta["input_token_logprobs"]) == 4 and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_top_logprobs"]) == 3
