"""How long a weight sync holds generation up, as answers grow: draining vs interrupting.

    .venv/bin/python -m bench.partial_rollouts [--lengths 64,256,1024] [--calls 4]

The embedded engine serves `tiny`, the gateway (a subprocess) is in front of it. For each answer
length L, `--calls` chat calls of exactly L sampled tokens (min_tokens = max_tokens = L) are
started; once the engine has sampled a few tokens of them, one weight sync is done the two ways
async training can do it, with the same weight load (`/update_weights_from_disk`, a new version):

* drain (`run.partial_rollouts: false`): the gateway paused and drained (`/admin/pause?wait=true`:
  the calls in flight finish on the old weights), the engine paused in place, the weights loaded,
  the engine continued, the gateway resumed;
* interrupt (partial rollouts, async mode's default): the gateway paused without draining, the
  engine paused in abort mode (the calls come back with their tokens), the weights loaded, the
  engine continued, the gateway resumed, and the gateway continues each call on the new weights.

Printed per L: the sync's pause (from its start until generation may go on), and that every call
still answered exactly L tokens, in the interrupted case with two weight versions in one turn.
Goal: interrupt's pause flat in L and <= 100 ms.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import statistics
import tempfile
import time

import httpx

from bench import common
from palaestra.engine.cli import engine_process
from palaestra.gateway.cli import gateway_process
from palaestra.models import resolve_model

KEY = {"Authorization": "Bearer bench"}
ADMIN = {"Authorization": "Bearer bench-admin"}
ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}


def generated(c: httpx.Client, engine_url: str) -> float:
    found = re.search(
        r"^palaestra_engine_generation_tokens_total (\S+)$", c.get(f"{engine_url}/metrics").text, re.M
    )
    return float(found.group(1)) if found else 0.0


def one_sync(c: httpx.Client, gw: str, engine: str, weights: str, version: str, interrupt: bool) -> float:
    """One weight sync the drain or the interrupt way; seconds until generation may go on."""
    t0 = time.perf_counter()
    c.post(
        f"{gw}/admin/pause", params={"wait": "false" if interrupt else "true"}, headers=ADMIN
    ).raise_for_status()
    c.post(
        f"{engine}/pause_generation", json={"mode": "abort" if interrupt else "in_place"}
    ).raise_for_status()
    r = c.post(f"{engine}/update_weights_from_disk", json={"model_path": weights, "weight_version": version})
    assert r.json()["success"], r.text
    c.post(f"{engine}/continue_generation", json={}).raise_for_status()
    c.post(f"{gw}/admin/resume", headers=ADMIN).raise_for_status()
    return time.perf_counter() - t0


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--lengths", default="64,256,1024", help="answer lengths in tokens (default: %(default)s)"
    )
    ap.add_argument("--calls", type=int, default=4, help="calls in flight at the sync (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per length and way; the median is shown")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    weights = str(resolve_model("tiny"))
    version = 0
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-spool-") as spool_dir,  # removed after the run
        engine_process("tiny", extra_args=["--num-threads", "1"]) as engine,
        gateway_process("tiny", engine.url, spool_dir, env=ENV) as gw,
        httpx.Client(timeout=600, trust_env=False) as c,
        cf.ThreadPoolExecutor(args.calls) as pool,
    ):

        def call(n: int) -> dict:
            s = c.post(f"{gw.url}/sessions", json={"env": "bench-partial"}, headers=KEY).json()
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a story."}],
                    "max_tokens": n, "min_tokens": n, "temperature": 1.0}  # fmt: skip
            r = c.post(
                f"{s['base_url']}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {s['api_key']}"},
            )
            r.raise_for_status()
            c.post(
                f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": 0.0}, headers=KEY
            ).raise_for_status()
            return r.json()

        for n in lengths:
            pauses: dict[str, list[float]] = {"drain": [], "interrupt": []}
            for _ in range(args.repeats):
                for way in ("drain", "interrupt"):
                    base = generated(c, engine.url)
                    calls = [pool.submit(call, n) for _ in range(args.calls)]
                    while generated(c, engine.url) < base + 2 * args.calls:  # all under way
                        time.sleep(0.005)
                    version += 1
                    pauses[way].append(
                        one_sync(c, gw.url, engine.url, weights, str(version), way == "interrupt")
                    )
                    answers = [f.result() for f in calls]
                    got = {a["usage"]["completion_tokens"] for a in answers}
                    assert got == {n}, f"{way}: answers of {got} tokens, not {n}"
            med = {w: statistics.median(p) * 1000 for w, p in pauses.items()}
            rows.append((n, med["drain"], med["interrupt"]))
            print(f"L={n}: drain {med['drain']:.0f} ms, interrupt {med['interrupt']:.0f} ms", flush=True)
    print(f"\n== sync pause vs answer length, {args.calls} calls in flight, median of {args.repeats}")
    print(f"{'tokens':>6s} {'drain ms':>9s} {'interrupt ms':>12s} {'drain/interrupt':>15s}")
    for n, d, i in rows:
        print(f"{n:6d} {d:9.0f} {i:12.0f} {d / i:14.1f}x")
    first, last = rows[0][2], rows[-1][2]
    print(f"interrupt: {last / first:.2f}x from {rows[0][0]} to {rows[-1][0]} tokens (flat is 1.0x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
