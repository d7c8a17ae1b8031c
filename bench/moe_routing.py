"""Routing replay's cost, one run, ratios: bytes of routed experts per token and the gateway's per-call overhead with them on vs off.

    .venv/bin/python -m bench.moe_routing [--calls 40] [--words 64] [--tokens 16] [--model tiny-moe]

Against the embedded engine serving `--model` with --enable-return-routed-experts:
* bytes per token on the wire: the engine's `meta_info.routed_experts` (base64 of int32
  [tokens, layers, top_k]) over the rows it covers, and in the Sample (`Sample.routed_experts`:
  the ids packed as uint8/uint16, base64 in JSON) over the sample's positions and its sampled tokens;
* the gateway's own cost per chat call with `return_routed_experts` on and off, two gateways in
  front of the same engine, interleaved call by call: the gateway process's CPU seconds per session
  (the call, its trajectory read and its reward call), read from /proc — the engine's ~100 ms
  per call on a shared CPU varies by more than the gateway's whole cost, so latency minus a direct
  /generate (also printed) is noise at this size; and the reward call's latency (linearize + spool).
"""

from __future__ import annotations

import base64
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import common
from bench.gateway import cpu_seconds
from palaestra.engine.cli import engine_process
from palaestra.gateway.cli import gateway_process

KEY = {"Authorization": "Bearer bench"}
ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--calls", type=int, default=40, help="calls per path")
    ap.add_argument("--words", type=int, default=64, help="words of each call's user message")
    ap.add_argument("--tokens", type=int, default=16, help="sampled tokens of each call")
    ap.add_argument("--model", default="tiny-moe", help="a MoE preset or directory")
    args = ap.parse_args()

    words = " ".join(["routing"] * args.words)
    messages = [{"role": "user", "content": words}]
    chat = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.tokens,
        "min_tokens": args.tokens,
        "temperature": 0,
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench-spool-") as spool_dir,  # removed after the run
        engine_process(
            args.model, extra_args=["--num-threads", "1", "--enable-return-routed-experts"]
        ) as engine,
        gateway_process(
            args.model,
            engine.url,
            str(Path(spool_dir) / "on"),
            env=ENV,
            extra_args=["--return-routed-experts"],
        ) as on,
        gateway_process(args.model, engine.url, str(Path(spool_dir) / "off"), env=ENV) as off,
        httpx.Client(timeout=300, trust_env=False) as c,
    ):

        def session(gw) -> tuple[str, dict]:
            s = c.post(f"{gw.url}/sessions", json={"env": "bench"}, headers=KEY).json()
            return s, {"Authorization": f"Bearer {s['api_key']}"}

        def gateway_call(gw) -> tuple[float, float, list[int]]:
            """One session of one chat call: the call's and its reward call's seconds, its prompt."""
            s, headers = session(gw)
            t0 = time.perf_counter()
            r = c.post(f"{s['base_url']}/chat/completions", json=chat, headers=headers)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            prompt = c.get(f"{gw.url}/sessions/{s['session_id']}", headers=KEY).json()["turns"][0][
                "prompt_ids"
            ]
            t0 = time.perf_counter()
            r = c.post(f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": 0.0}, headers=KEY)
            assert r.status_code == 200, r.text
            return dt, time.perf_counter() - t0, prompt

        def direct(ids: list[int], routing: bool) -> tuple[float, dict]:
            body = {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": args.tokens,
                    "min_new_tokens": args.tokens,
                    "temperature": 0,
                },
                "return_logprob": True,
                "return_routed_experts": routing,
            }
            t0 = time.perf_counter()
            r = c.post(f"{engine.url}/generate", json=body)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            return dt, r.json()

        *_, ids = gateway_call(off)  # warm both paths; the prompt every call sends
        gateway_call(on)
        times: dict[str, list[float]] = {"on": [], "off": [], "direct_on": [], "direct_off": []}
        cost: dict[str, list[float]] = {"on": [], "off": []}
        rewards: dict[str, list[float]] = {"on": [], "off": []}
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.calls):
            for name, gw in (("on", on), ("off", off)):
                before = cpu_seconds(gw.pid)
                call_s, reward_s, _ = gateway_call(gw)
                cpu[name].append(cpu_seconds(gw.pid) - before)
                direct_s = direct(ids, name == "on")[0]
                times[name].append(call_s)
                times[f"direct_{name}"].append(direct_s)
                cost[name].append(call_s - direct_s)
                rewards[name].append(reward_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        over_on, over_off = statistics.median(cost["on"]), statistics.median(cost["off"])
        reward_on, reward_off = statistics.median(rewards["on"]), statistics.median(rewards["off"])
        cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])

        _, answer = direct(ids, True)
        wire = answer["meta_info"]["routed_experts"]
        rows = len(ids) + len(answer["output_ids"]) - 1
        ints = len(base64.b64decode(wire)) // 4

        page = c.get(f"{on.url}/samples", params={"after": 0}, headers=KEY).json()
        sample = page["samples"][-1]
        packed = sample["routed_experts"]
        sampled = sum(sample["loss_mask"])

    print(f"model {args.model}: {ints // max(rows, 1)} expert ids per position (layers x top_k)")
    print(
        f"wire (engine base64 int32): {len(wire) / rows:.1f} bytes per position, "
        f"{len(wire) / args.tokens:.1f} per sampled token of a {len(ids)}-token prompt call"
    )
    print(
        f"sample JSON ({packed['dtype']}, base64): {len(packed['data']) / packed['shape'][0]:.1f} bytes per position, "
        f"{len(packed['data']) / sampled:.1f} per sampled token ({sampled} sampled of {len(sample['tokens'])}); "
        f"{len(wire) / rows / (len(packed['data']) / packed['shape'][0]):.1f}x smaller than the wire"
    )
    print(
        f"gateway overhead per call (median, minus a direct /generate of the same ids), {args.calls} calls each: "
        f"routing off {over_off * 1e3:.2f} ms, on {over_on * 1e3:.2f} ms, ratio {over_on / over_off:.2f}x; "
        f"engine /generate itself: off {med['direct_off'] * 1e3:.1f} ms, on {med['direct_on'] * 1e3:.1f} ms"
    )
    print(
        f"gateway CPU per session (one call, its trajectory, its reward; median): off {cpu_off * 1e3:.2f} ms, "
        f"on {cpu_on * 1e3:.2f} ms, ratio {cpu_on / cpu_off:.2f}x"
    )
    print(
        f"reward call (linearize + spool, one turn): off {reward_off * 1e3:.2f} ms, on {reward_on * 1e3:.2f} ms, "
        f"ratio {reward_on / reward_off:.2f}x"
    )


if __name__ == "__main__":
    main()
