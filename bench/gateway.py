"""Gateway benchmark, one run, ratios: per-call overhead, per-turn CPU growth, turns/s under concurrency.

    .venv/bin/python bench/gateway.py [--calls 300] [--turns 64] [--sessions 24]

Everything runs against a zero-work engine (bench/zero_engine.py), so only the layers in front of it
are measured:
* per-call overhead: gateway (chat call: render, bridge, record, answer) and the real sglang-router,
  each minus a direct /generate to the same engine (goal: gateway <= router);
* gateway CPU per turn at turn 64 vs turn 1 of long sessions, read from /proc (goal <= 1.5x);
* turns/s through the gateway at 1, 16 and 128 concurrent sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from palaestra.engine.router import RouterProcess  # noqa: E402
from palaestra.gateway.cli import gateway_process  # noqa: E402
from palaestra.net import ServerProcess, free_port  # noqa: E402

KEY = {"Authorization": "Bearer bench"}
ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_latency(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per path in the overhead test")
    ap.add_argument("--turns", type=int, default=64, help="turns per session in the CPU-growth test")
    ap.add_argument("--sessions", type=int, default=24, help="sessions in the CPU-growth test")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    reply = tok.encode("Sure, here it is.", add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    port = free_port()
    zero = ServerProcess(
        [
            sys.executable,
            str(Path(__file__).with_name("zero_engine.py")),
            "--port",
            str(port),
            "--reply-ids",
            *map(str, reply),
        ],
        f"http://127.0.0.1:{port}",
        name="zero-engine",
    )
    spool = Path("runs/bench-gateway-spool")
    with (
        zero,
        RouterProcess([zero.url]) as router,
        gateway_process("tiny", zero.url, str(spool / str(time.time())), env=ENV) as gw,
        httpx.Client(timeout=60, trust_env=False) as c,
    ):
        gen_body = {"input_ids": reply * 8, "sampling_params": {"max_new_tokens": 8}}

        def new_session() -> str:
            return c.post(f"{gw.url}/sessions", json={"env": "bench"}, headers=KEY).json()["base_url"]

        base = new_session()
        chat_body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": 8,
        }
        for _ in range(20):  # warm-up of every path
            c.post(f"{zero.url}/generate", json=gen_body)
            c.post(f"{router.url}/generate", json=gen_body, headers={"X-SMG-Routing-Key": "k"})
            c.post(f"{base}/chat/completions", json=chat_body, headers=KEY)
        direct = median_latency(lambda: c.post(f"{zero.url}/generate", json=gen_body), args.calls)
        routed = median_latency(
            lambda: c.post(f"{router.url}/generate", json=gen_body, headers={"X-SMG-Routing-Key": "k"}),
            args.calls,
        )
        gated = median_latency(
            lambda: c.post(f"{base}/chat/completions", json=chat_body, headers=KEY), args.calls
        )
        r_over, g_over = routed - direct, gated - direct
        print(
            f"per-call overhead over a direct /generate ({direct * 1e3:.2f} ms): router {r_over * 1e3:.2f} ms, "
            f"gateway {g_over * 1e3:.2f} ms  -> gateway/router = {g_over / r_over:.2f}x"
        )

        # CPU per turn at turn 1 vs turn N (lockstep rounds over many sessions, CPU read from /proc)
        sessions = [
            (new_session(), [{"role": "system", "content": "You are a helpful agent. " * 20}])
            for _ in range(args.sessions)
        ]
        per_turn = []
        for turn in range(args.turns):
            before = cpu_seconds(gw.pid)
            for url, msgs in sessions:
                msgs.append(
                    {"role": "user", "content": f"Turn {turn}: please continue the task with more detail."}
                )
                r = c.post(f"{url}/chat/completions", json={"model": "tiny", "messages": msgs}, headers=KEY)
                r.raise_for_status()
                msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            per_turn.append((cpu_seconds(gw.pid) - before) / len(sessions))
        first, last = statistics.mean(per_turn[:2]), statistics.mean(per_turn[-2:])
        prompt_len = len(
            tok.encode(tok.apply_chat_template(sessions[0][1], tokenize=False), add_special_tokens=False)
        )
        print(
            f"gateway CPU per turn: turn 1 = {first * 1e3:.2f} ms, turn {args.turns} = {last * 1e3:.2f} ms "
            f"(history {prompt_len} tokens)  -> {last / first:.2f}x"
        )

        # turns/s at several concurrency levels
        async def load(concurrency: int, calls_each: int) -> float:
            async with httpx.AsyncClient(
                timeout=120, trust_env=False, limits=httpx.Limits(max_connections=concurrency + 8)
            ) as ac:
                urls = [
                    (await ac.post(f"{gw.url}/sessions", json={"env": "bench"}, headers=KEY)).json()[
                        "base_url"
                    ]
                    for _ in range(concurrency)
                ]

                async def session(url: str) -> None:
                    msgs = [{"role": "user", "content": "hello"}]
                    for _ in range(calls_each):
                        r = await ac.post(
                            f"{url}/chat/completions", json={"model": "tiny", "messages": msgs}, headers=KEY
                        )
                        msgs += [
                            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "more"},
                        ]

                t0 = time.perf_counter()
                await asyncio.gather(*[session(u) for u in urls])
                return concurrency * calls_each / (time.perf_counter() - t0)

        rates, cpu = {}, {}
        for n in (1, 16, 128):
            calls = max(4, 256 // n)
            before = cpu_seconds(gw.pid)
            rates[n] = asyncio.run(load(n, calls))
            cpu[n] = (cpu_seconds(gw.pid) - before) / (n * calls + n)  # + one session creation each
        print(
            "turns/s through the gateway: "
            + ", ".join(f"{n} sessions = {r:.0f}" for n, r in rates.items())
            + f"  -> 128 vs 1: {rates[128] / rates[1]:.2f}x"
        )
        print(
            "gateway CPU per call: "
            + ", ".join(f"{n} sessions = {c * 1e3:.2f} ms" for n, c in cpu.items())
            + f"  -> 128 vs 1: {cpu[128] / cpu[1]:.2f}x (client, engine and gateway share 2 cores)"
        )


if __name__ == "__main__":
    main()
