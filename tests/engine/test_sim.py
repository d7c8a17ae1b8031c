"""The simulated engine over HTTP (palaestra/testing/sim.py), alone and behind the real sglang-router.

Checks the protocol and the router's worker targeting the placement layer relies on; no timing:
modelled latencies are compared with the model's own arithmetic, never with the wall clock.
"""

from __future__ import annotations

import httpx
import pytest

from palaestra.engine.protocol import RequestError, error_body, parse_generate
from palaestra.engine.router import RouterProcess
from palaestra.testing import sim
from palaestra.testing.sim_model import SimParams


@pytest.fixture(scope="module")
def engines():
    with sim.process(5) as proc:
        yield proc


def generate(url: str, ids: list[int], n: int = 4, seed: int = 1, headers: dict | None = None, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "sampling_seed": seed}, **extra}
    return httpx.post(url + "/generate", json=body, headers=headers or {}, timeout=60, trust_env=False)


def test_answers_and_reports_its_prefix_cache(engines):
    url = engines.urls[0]
    first = generate(url, list(range(1000, 1640)), n=8, return_logprob=True)
    assert first.status_code == 200, first.text
    a = first.json()
    assert len(a["output_ids"]) == 8
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == 640 and meta["completion_tokens"] == 8 and meta["cached_tokens"] == 0
    assert [e[1] for e in meta["output_token_logprobs"]] == a["output_ids"]
    p = SimParams()
    assert meta["sim"]["first_token_s"] == pytest.approx(640 / p.prefill_tokens_per_s)
    # the next turn: the prompt and answer are cached (in whole blocks)
    again = generate(url, list(range(1000, 1640)) + a["output_ids"] + [5, 6, 7], n=2).json()
    assert again["meta_info"]["cached_tokens"] == (640 + 8) // p.block_tokens * p.block_tokens
    stats = httpx.get(url + "/sim/stats", trust_env=False).json()
    assert stats["stats"]["requests"] == 2 and stats["stats"]["cached_tokens"] > 0


def test_answers_depend_on_prompt_and_seed_not_on_the_engine(engines):
    ids = list(range(50, 350))
    a = generate(engines.urls[1], ids, seed=9).json()["output_ids"]
    b = generate(engines.urls[2], ids, seed=9).json()["output_ids"]
    c = generate(engines.urls[2], ids, seed=10).json()["output_ids"]
    assert a == b and a != c


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"text": "hello"}, "input_ids"),
        ({"input_ids": [[1, 2], [3]]}, "input_ids"),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [7] * 600_000}, "context length"),
    ],
)
def test_what_it_does_not_simulate_is_a_400_naming_the_field(engines, body, named):
    r = httpx.post(engines.urls[3] + "/generate", json=body, timeout=60, trust_env=False)
    assert r.status_code == 400
    assert named in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2], "bogus": 1},
        {"input_ids": [1, 2], "sampling_params": {"top_p": 2}},
        {"input_ids": [1, 200_000]},
        {"input_ids": []},
        {"input_ids": [1, 2], "image_data": "x"},
        [1, 2],
    ],
)
def test_a_bad_body_gets_the_real_engines_400(engines, body):
    """The same parser as the embedded engine (engine/protocol.py): the same message, the same shape."""
    with pytest.raises(RequestError) as real:
        parse_generate(
            body,
            tokenize=list,
            vocab_size=sim.VOCAB_SIZE,
            context_length=SimParams().kv_capacity_tokens,
            defaults={},
        )
    r = httpx.post(engines.urls[3] + "/generate", json=body, timeout=60, trust_env=False)
    assert r.status_code == real.value.status == 400
    assert r.json() == error_body(str(real.value), 400)


def test_target_worker_header_picks_the_router_listed_worker(engines):
    """sglang-router 0.3.2's consistent_hashing honours X-SMG-Target-Worker as an index into its
    GET /workers list (not the --worker-urls order); a missing index is a 503 before any work."""
    with RouterProcess(engines.urls, log_level="warn") as router:
        listed = [w["url"] for w in httpx.get(router.url + "/workers", trust_env=False).json()["workers"]]
        assert sorted(listed) == sorted(engines.urls)
        for i, url in enumerate(listed):
            r = generate(
                router.url, [7, 8, 9] * 20, headers={"X-SMG-Target-Worker": str(i), "X-SMG-Routing-Key": "k"}
            )
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["sim"]["engine"] == f"sim-{url.rsplit(':', 1)[1]}"
        miss = generate(router.url, [1, 2, 3], headers={"X-SMG-Target-Worker": str(len(listed))})
        assert miss.status_code == 503
        assert miss.headers.get("x-smg-error-code") == "no_available_workers"


def test_cli_refuses_unknown_parameters_by_name():
    with pytest.raises(SystemExit):
        sim.main(["--port", "1", "--param", "nope=3"])
    assert sim._parse_overrides(["kv_capacity_tokens=1000", "decode_step_s=0.01"]) == {
        "kv_capacity_tokens": 1000,
        "decode_step_s": 0.01,
    }
