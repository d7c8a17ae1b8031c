"""Embedded-engine benchmark: batching, prefix cache and router overhead, as ratios from one run.

    .venv/bin/python -m bench.engine [--model tiny] [--tokens 128] [--batch 16]

Prints:
* decode tokens/s at batch 1 vs batch N (the ratio shows that concurrent requests share forwards);
* time to first token with a prefix-cache hit vs cold, for a long prompt;
* the real sglang-router's added latency per request against direct calls to the same engine.
Absolute numbers depend on this machine's load; the ratios are what to compare between runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import statistics
import time

import httpx

from bench import common
from palaestra.engine.cli import engine_process
from palaestra.engine.router import RouterProcess


def decode_throughput(c: httpx.Client, url: str, batch: int, tokens: int, vocab: int) -> float:
    rng = random.Random(batch)
    bodies = [
        {
            "input_ids": [rng.randrange(vocab) for _ in range(16)],
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
        }
        for _ in range(batch)
    ]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda b: c.post(f"{url}/generate", json=b).json(), bodies))
    wall = time.perf_counter() - t0
    assert all(o["meta_info"]["completion_tokens"] == tokens for o in outs)
    return batch * tokens / wall


def ttft(c: httpx.Client, url: str, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = c.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).json()
    return time.perf_counter() - t0, r["meta_info"]["cached_tokens"]


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny", help="preset or HF directory (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request in the decode test")
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests in the batched decode test")
    ap.add_argument("--prompt", type=int, default=3000, help="prompt tokens in the prefix-cache test")
    ap.add_argument("--requests", type=int, default=200, help="requests per path in the router test")
    args = ap.parse_args()

    with engine_process(args.model) as eng, httpx.Client(timeout=600, trust_env=False) as c:
        vocab = min(c.get(f"{eng.url}/server_info").json().get("vocab_size", 2000), 2000)
        decode_throughput(c, eng.url, 2, 8, vocab)  # warm-up
        single = decode_throughput(c, eng.url, 1, args.tokens, vocab)
        batched = decode_throughput(c, eng.url, args.batch, args.tokens, vocab)
        print(
            f"decode tokens/s: batch 1 = {single:.0f}, batch {args.batch} = {batched:.0f}  "
            f"-> batching speed-up {batched / single:.2f}x"
        )

        rng = random.Random(0)
        cold_t, hot_t = [], []
        for _ in range(5):
            history = [rng.randrange(vocab) for _ in range(args.prompt)]
            assert c.post(f"{eng.url}/flush_cache").status_code == 200
            t, cached = ttft(c, eng.url, history)
            assert cached == 0
            cold_t.append(t)
            t, cached = ttft(c, eng.url, history + [rng.randrange(vocab) for _ in range(16)])
            assert cached >= args.prompt - 1, cached
            hot_t.append(t)
        cold, hot = statistics.median(cold_t), statistics.median(hot_t)
        print(
            f"time to first token, {args.prompt}-token history: cold = {cold * 1e3:.1f} ms, "
            f"prefix-cache hit = {hot * 1e3:.1f} ms  -> hit is {cold / hot:.1f}x faster"
        )

        with RouterProcess([eng.url], router_options=["--router-health-check-interval-secs", "5"]) as router:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            direct_t, routed_t = [], []
            for i in range(args.requests):  # interleave so load drift hits both paths alike
                for url, acc in ((eng.url, direct_t), (router.url, routed_t)):
                    t0 = time.perf_counter()
                    r = c.post(f"{url}/generate", json=body, headers={"X-SMG-Routing-Key": f"k{i % 10}"})
                    acc.append(time.perf_counter() - t0)
                    assert r.status_code == 200
            d, rt = statistics.median(direct_t), statistics.median(routed_t)
            print(
                f"per-request latency (median of {args.requests}): direct = {d * 1e3:.2f} ms, via router = "
                f"{rt * 1e3:.2f} ms  -> router adds {(rt - d) * 1e3:.2f} ms ({rt / d:.2f}x)"
            )


if __name__ == "__main__":
    main()
