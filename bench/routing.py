"""Routing benchmark, one run: sglang-router's own policies vs the placement layer, same trace.

    flock /tmp/palaestra-heavy.lock .venv/bin/python -m bench.routing
    flock /tmp/palaestra-heavy.lock .venv/bin/python -m bench.routing --engines 16 --scaling 4,16,64
    flock /tmp/palaestra-heavy.lock .venv/bin/python -m bench.routing --trace runs/recorded.jsonl --scale 40
    # one policy per process (the rows of docs/routing.md): a policy's row is not run in the wake
    # of another's engines, and a run stopped at its time limit keeps the rows before it
    flock /tmp/palaestra-heavy.lock nice -n -15 .venv/bin/python -m bench.routing --engines 16 --scaling '' \
        --policies 'placement +prefix' --duration-s 110 --warmup-s 50 --time-scale 1

Each policy gets fresh simulated engines (`palaestra.testing.sim`: Llama-3-8B on one H100 each, the
parameter table in palaestra/testing/sim_model.py) behind a fresh real sglang-router (`palaestra router
serve`, 127.0.0.1), and the same trace (bench/routing_trace.py: GRPO groups in bursts, long tool
sessions, harness-like episodes; or a recorded `palaestra train` run scaled up). The replay keeps
each env's sessions in flight up to its cap (a rollout runner's concurrency), sends each turn
after the previous answer plus its tool time, and measures, over the window after the warm-up:

* tokens/s: output tokens of the turns finished in the window per modelled second;
* p50/p99 time per turn (send to answer, modelled seconds);
* prefix-cache hit rate: prompt tokens the engines served from cache / prompt tokens;
* max/mean worker load: the engine with the most KV in use (time average) over the mean;
* sessions moved: sessions whose turns were answered by more than one engine.

Router-only policies send `X-SMG-Routing-Key: <session>` (what the gateway sends today); the
placement rows choose `X-SMG-Target-Worker` with gateway/engine_side/placement.py over `consistent_hashing`.
Ratios are against the best router-only policy by tokens/s. All times are modelled seconds: with
`--time-scale S` the engines run S times slower in wall time and the bench divides by S. Each run
prints the harness's own cost: the CPU share of the client, the engines and the router, how late
the engines' timers fired, and the unmodelled time per call (HTTP, router, client).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson

from bench import common, routing_trace
from palaestra.engine.router import RouterProcess
from palaestra.gateway.engine_side.placement import Call, PlacementConfig, Route, SessionPlacement
from palaestra.testing import sim as sim_engine

ROUTER_POLICIES = ("round_robin", "cache_aware", "consistent_hashing", "manual min_load")
# the router's flags for each row (its `manual` policy: a routing key sticks to the worker it was
# first given, new keys go to the worker with the fewest requests in flight)
ROUTER_ARGS = {"manual min_load": ("manual", ["--router-assignment-mode", "min_load"])}
# ours, and the ideas it is made of, measured one at a time
PLACEMENTS: dict[str, PlacementConfig] = {
    "placement": PlacementConfig(),  # the gateway's defaults with --placement
    "placement +prefix": PlacementConfig(new_sessions="env_prefix"),
    "placement -group": PlacementConfig(groups="apart"),
    "placement +pools": PlacementConfig(pools=True),
    "placement +admission": PlacementConfig(admit_fill=0.9),
}
VOCAB = (1000, 30000)


# -- what one turn measured -------------------------------------------------------------------
@dataclass
class TurnRecord:
    env: str
    session: str
    turn: int
    sent: float  # modelled seconds since the replay started
    done: float
    prompt: int
    cached: int
    out: int
    engine: str
    modelled: float  # the engine's own modelled time for the call
    to_engine: float = 0.0  # wall seconds from the client's send to the engine's arrival
    from_engine: float = 0.0  # wall seconds from the engine's answer to the client's receipt


@dataclass
class RunResult:
    policy: str
    engines: int
    window: tuple[float, float]
    turns: list[TurnRecord]
    engine_stats: list[dict[str, Any]]
    cpu: dict[str, float]
    placement: dict[str, Any] | None = None
    failures: int = 0

    def in_window(self) -> list[TurnRecord]:
        lo, hi = self.window
        return [t for t in self.turns if lo <= t.done <= hi]

    def tokens_per_s(self) -> float:
        lo, hi = self.window
        return sum(t.out for t in self.in_window()) / (hi - lo)

    def turn_times(self) -> list[float]:
        return sorted(t.done - t.sent for t in self.in_window())

    def pct(self, q: float) -> float:
        xs = self.turn_times()
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def hit_rate(self) -> float:
        ts = self.in_window()
        prompt = sum(t.prompt for t in ts)
        return sum(t.cached for t in ts) / prompt if prompt else float("nan")

    def load_max_over_mean(self) -> float:
        """The busiest engine's mean KV in use over the engines' mean (how unevenly work sits)."""
        kv = [e["stats"]["kv_token_s"] / max(e["now_s"], 1e-9) for e in self.engine_stats]
        mean = sum(kv) / len(kv)
        return max(kv) / mean if mean else float("nan")

    def utilisation(self) -> float:
        busy = [e["stats"]["busy_s"] / max(e["now_s"], 1e-9) for e in self.engine_stats]
        return sum(busy) / len(busy)

    def moved_sessions(self) -> int:
        seen: dict[str, set[str]] = defaultdict(set)
        for t in self.turns:
            seen[t.session].add(t.engine)
        return sum(1 for engines in seen.values() if len(engines) > 1)

    def sessions(self) -> int:
        return len({t.session for t in self.turns})

    def overhead(self) -> tuple[float, float]:
        """Unmodelled time per call (HTTP, router, client, late timers): p50 and p99, modelled s."""
        xs = sorted(max(0.0, (t.done - t.sent) - t.modelled) for t in self.in_window())
        if not xs:
            return float("nan"), float("nan")
        return xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.99 * len(xs)))]


# -- routing headers per policy ---------------------------------------------------------------
class RouterOnly:
    """Today's gateway: the session id as the routing key; the router's policy decides."""

    async def admit(self, call: Call) -> None:
        pass

    def route(self, call: Call) -> tuple[dict[str, str], Route | None]:
        return {"X-SMG-Routing-Key": call.session}, None

    def ended(self, session: str) -> None:
        pass

    def snapshot(self) -> dict[str, Any] | None:
        return None


class Placed:
    """The placement layer choosing the target worker (gateway/engine_side/placement.py, unchanged)."""

    def __init__(
        self, config: PlacementConfig, workers: list[str], clock: Callable[[], float], time_scale: float
    ) -> None:
        self.placement = SessionPlacement(config, workers, clock=clock, time_scale=time_scale)
        for url in workers:  # what the gateway reads from each worker's /server_info
            info = httpx.get(url + "/server_info", timeout=10, trust_env=False).json()
            self.placement.set_capacity(url, int(info["max_total_num_tokens"]))

    async def admit(self, call: Call) -> None:
        await self.placement.admit(call)

    def route(self, call: Call) -> tuple[dict[str, str], Route | None]:
        r = self.placement.choose(call)
        return r.call_headers(), r

    def ended(self, session: str) -> None:
        self.placement.ended(session)

    def snapshot(self) -> dict[str, Any] | None:
        return {**self.placement.snapshot(), "health_changes": self.health_changes}

    health_changes = 0

    async def follow(self, http: aiohttp.ClientSession, router_url: str) -> None:
        """Re-reads the router's worker list every 2 s, as the gateway does (gateway/engine_side/routing.py)."""
        while True:
            await asyncio.sleep(2.0)
            try:
                async with http.get(router_url + "/workers") as r:
                    workers = (await r.json())["workers"]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                continue
            urls = [w["url"] for w in workers]
            healthy = [bool(w.get("is_healthy", True)) for w in workers]
            if healthy != [w.healthy for w in self.placement.workers] or urls != [
                w.url for w in self.placement.workers
            ]:
                self.health_changes += 1
                self.placement.set_workers(urls, healthy)


# -- the replay -------------------------------------------------------------------------------
def _ids(seed: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(seed)) % (2**63))
    return rng.integers(*VOCAB, size=n, dtype=np.int32)


class Replay:
    def __init__(
        self,
        groups: list[routing_trace.Group],
        caps: dict[str, int],
        url: str,
        policy: RouterOnly | Placed,
        *,
        duration_s: float,
        time_scale: float,
    ) -> None:
        self.groups = groups
        self.caps = caps
        self.url = url
        self.policy = policy
        self.duration = duration_s
        self.scale = time_scale
        self.turns: list[TurnRecord] = []
        self.failures = 0
        self._env_ids: dict[str, np.ndarray] = {}
        self._t0 = 0.0
        self._stop = False

    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.scale

    async def run(self) -> None:
        self._t0 = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:
            self.http = http
            by_env: dict[str, list[routing_trace.Group]] = defaultdict(list)
            for g in self.groups:
                by_env[g.env].append(g)
            runners = [asyncio.create_task(self._env_runner(env, gs)) for env, gs in by_env.items()]
            if isinstance(self.policy, Placed):
                runners.append(asyncio.create_task(self.policy.follow(http, self.url)))
            await asyncio.sleep(self.duration * self.scale)
            self._stop = True
            for r in runners:
                r.cancel()
            await asyncio.gather(*runners, return_exceptions=True)

    async def _env_runner(self, env: str, groups: list[routing_trace.Group]) -> None:
        cap = self.caps.get(env, 10**9)
        inflight = 0
        changed = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        def finished(_: asyncio.Task) -> None:
            nonlocal inflight
            inflight -= 1
            changed.set()

        try:
            for g in groups:
                wait = g.release_s - self.now()
                if wait > 0:
                    await asyncio.sleep(wait * self.scale)
                while inflight and inflight + len(g.sessions) > cap:
                    changed.clear()
                    await changed.wait()
                for s in g.sessions:
                    inflight += 1
                    t = asyncio.create_task(self._session(g, s))
                    t.add_done_callback(finished)
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _prefix(self, env: str, n: int) -> np.ndarray:
        ids = self._env_ids.get(env)
        if ids is None or len(ids) < n:
            ids = self._env_ids[env] = _ids(f"env:{env}", n)
        return ids[:n]

    async def _session(self, g: routing_trace.Group, s: routing_trace.Session) -> None:
        prompt = np.concatenate(
            [
                self._prefix(g.env, g.env_prefix),
                _ids(f"group:{g.group}", g.group_prefix),
                _ids(f"{s.session}/0", s.turns[0].new),
            ]
        )
        seed = abs(hash(s.session)) % (2**31)
        out: np.ndarray | None = None
        for k in range(1, s.start_turn + 1):  # a session already under way: its history so far
            prev = s.turns[k - 1]
            prompt = np.concatenate(
                [prompt, _ids(f"{s.session}/out{k - 1}", prev.out), _ids(f"{s.session}/{k}", s.turns[k].new)]
            )
        try:
            for k, turn in enumerate(s.turns):
                if k < s.start_turn:
                    continue
                if k > s.start_turn:
                    await asyncio.sleep(turn.gap_s * self.scale)
                    prompt = np.concatenate([prompt, out, _ids(f"{s.session}/{k}", turn.new)])
                if self._stop:
                    return
                out = await self._call(g, s, k, prompt, turn.out, seed)
                if out is None:
                    return
        finally:
            self.policy.ended(s.session)

    async def _call(
        self,
        g: routing_trace.Group,
        s: routing_trace.Session,
        k: int,
        prompt: np.ndarray,
        n_out: int,
        seed: int,
    ) -> np.ndarray | None:
        call = Call(s.session, g.env, g.group, k, len(prompt), n_out)
        sent = self.now()  # a turn's time includes what it waited for admission
        await self.policy.admit(call)
        headers, route = self.policy.route(call)
        headers = {**headers, "content-type": "application/json"}
        body = orjson.dumps(
            {"input_ids": prompt, "sampling_params": {"max_new_tokens": n_out, "sampling_seed": seed}},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        for _attempt in range(4):
            sent_wall = time.monotonic()
            async with self.http.post(f"{self.url}/generate", data=body, headers=headers) as r:
                raw = await r.read()
                status = r.status
            if status == 200:
                break
            if status == 503 and route is not None:
                route = route.retry()
                headers = {**route.call_headers(), "content-type": "application/json"}
                continue
            break
        if status != 200:
            self.failures += 1
            if route is not None:
                route.abandoned()
            return None
        got_wall = time.monotonic()
        answer = orjson.loads(raw)
        meta = answer["meta_info"]
        ids = np.asarray(answer["output_ids"], dtype=np.int32)
        if route is not None:
            route.done(int(meta.get("cached_tokens") or 0), len(ids))
        self.turns.append(
            TurnRecord(
                g.env, s.session, k, sent, self.now(), len(prompt), int(meta.get("cached_tokens") or 0),
                len(ids), meta["sim"]["engine"], float(meta["sim"]["modelled_s"]),
                meta["sim"]["arrived_monotonic"] - sent_wall, got_wall - meta["sim"]["answered_monotonic"],
            )
        )  # fmt: skip
        return ids


# -- one cluster, one policy ------------------------------------------------------------------
def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _get_json(url: str) -> Any:
    """GET with patience: an engine process that fell behind answers late, not never."""
    for attempt in range(5):
        try:
            return httpx.get(url, timeout=60, trust_env=False).json()
        except httpx.HTTPError:
            if attempt == 4:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def run_policy(
    policy: str,
    groups: list[routing_trace.Group],
    caps: dict[str, int],
    *,
    engines: int,
    duration_s: float,
    warmup_s: float,
    time_scale: float,
    sim_procs: int,
    sim_params: dict[str, float],
) -> RunResult:
    per_proc = [engines // sim_procs + (1 if i < engines % sim_procs else 0) for i in range(sim_procs)]
    sims = [sim_engine.process(n, time_scale=time_scale, params=sim_params) for n in per_proc if n]
    router_policy, router_options = ROUTER_ARGS.get(
        policy, (policy if policy in ROUTER_POLICIES else "consistent_hashing", [])
    )
    for s in sims:
        s.start()
    try:
        urls = [u for s in sims for u in s.urls]
        with RouterProcess(
            urls, policy=router_policy, router_options=router_options, log_level="warn", startup_timeout=120
        ) as router:
            order = [w["url"] for w in _get_json(router.url + "/workers")["workers"]]
            replay_holder: dict[str, Replay] = {}
            clock = lambda: replay_holder["r"].now()  # noqa: E731 - modelled seconds, for the placement layer
            chooser: RouterOnly | Placed = (
                RouterOnly()
                if policy in ROUTER_POLICIES
                else Placed(PLACEMENTS[policy], order, clock, time_scale)
            )
            replay = Replay(groups, caps, router.url, chooser, duration_s=duration_s, time_scale=time_scale)
            replay_holder["r"] = replay
            pids = {"sims": [s.pid for s in sims], "router": router.pid}
            cpu0 = {
                "client": time.process_time(),
                "router": _cpu_s(router.pid),
                "sims": sum(_cpu_s(p) for p in pids["sims"]),
            }
            wall0 = time.monotonic()
            asyncio.run(replay.run())
            wall = time.monotonic() - wall0
            cpu = {
                "client": (time.process_time() - cpu0["client"]) / wall,
                "router": (_cpu_s(router.pid) - cpu0["router"]) / wall,
                "sims": (sum(_cpu_s(p) for p in pids["sims"]) - cpu0["sims"]) / wall,
                "loadavg": os.getloadavg()[0],
            }
            stats = [_get_json(u + "/sim/stats") for u in urls]
    finally:
        for s in sims:
            s.stop()
    return RunResult(
        policy, engines, (warmup_s, duration_s), replay.turns, stats, cpu, chooser.snapshot(), replay.failures
    )


# -- printing ---------------------------------------------------------------------------------
def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"  # NaN


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


def row(r: RunResult) -> str:
    """One policy's numbers, without ratios (they need the whole table)."""
    return (
        f"tokens/s {r.tokens_per_s():.0f}, p50 turn {_fmt(r.pct(0.5))} s, p99 turn {_fmt(r.pct(0.99))} s, "
        f"hit rate {_fmt(r.hit_rate(), 3)}, load max/mean {_fmt(r.load_max_over_mean())}, "
        f"moved {r.moved_sessions()} of {r.sessions()} sessions"
    )


def print_table(results: list[RunResult]) -> None:
    router_only = [r for r in results if r.policy in ROUTER_POLICIES] or results
    best = max(router_only, key=lambda r: r.tokens_per_s())
    print(
        f"{'policy':<22}{'tokens/s':>10}{'x best':>8}{'p50 turn s':>12}{'p99 turn s':>12}{'x best p99':>12}"
        f"{'hit rate':>10}{'load max/mean':>15}{'moved':>8}{'sessions':>10}"
    )
    for r in results:
        print(
            f"{r.policy:<22}{r.tokens_per_s():>10.0f}{_ratio(r.tokens_per_s(), best.tokens_per_s()):>8.2f}"
            f"{_fmt(r.pct(0.5)):>12}{_fmt(r.pct(0.99)):>12}{_ratio(r.pct(0.99), best.pct(0.99)):>12.2f}"
            f"{_fmt(r.hit_rate(), 3):>10}{_fmt(r.load_max_over_mean()):>15}{r.moved_sessions():>8}{r.sessions():>10}"
        )
    print(f"best router-only policy by tokens/s: {best.policy}")


def print_costs(r: RunResult, time_scale: float) -> None:
    lag = [e["timer_lag_s"] for e in r.engine_stats]
    lag_mean = sum(x["mean"] * x["n"] for x in lag) / max(1, sum(x["n"] for x in lag))
    lag_max = max(x["max"] for x in lag)
    o50, o99 = r.overhead()
    p50 = r.pct(0.5)
    ts = r.in_window()
    to = sorted(t.to_engine for t in ts) or [float("nan")]
    back = sorted(t.from_engine for t in ts) or [float("nan")]
    print(
        f"  [{r.policy}] cpu (share of one core): client {r.cpu['client']:.0%}, engines {r.cpu['sims']:.0%}, "
        f"router {r.cpu['router']:.0%}; load avg {r.cpu['loadavg']:.1f}; engine timers late by "
        f"{lag_mean * 1e3:.1f} ms mean, {lag_max * 1e3:.0f} ms max (wall); unmodelled time per call "
        f"p50 {o50 * 1e3:.1f} ms, p99 {o99 * 1e3:.0f} ms ({o50 / p50:.1%} of the p50 turn; to the engine p50 "
        f"{to[len(to) // 2] * 1e3:.1f} ms p99 {to[int(0.99 * (len(to) - 1))] * 1e3:.0f} ms wall, back p50 "
        f"{back[len(back) // 2] * 1e3:.1f} ms); engines busy "
        f"{r.utilisation():.0%}; failed calls {r.failures}"
    )
    if r.placement is not None:
        a = r.placement["admission"]
        print(
            f"  [{r.policy}] placement: {r.placement['moves']} moves {r.placement['moves_by_reason']}, "
            f"{a['waited']} new sessions waited for room ({a['wait_s_total']:.0f} s in all, {a['timeouts']} "
            f"gave up waiting), {r.placement['health_changes']} changes of the router's worker list seen"
        )
    st = [e["stats"] for e in r.engine_stats]
    print(
        f"  [{r.policy}] engines: prefill {sum(x['prefill_s'] for x in st) / max(1e-9, sum(x['busy_s'] for x in st)):.0%} "
        f"of busy time, {sum(x['prefilled_tokens'] for x in st)} tokens prefilled, "
        f"{sum(x['evicted_tokens'] for x in st)} evicted, {sum(x['retractions'] for x in st)} retractions, "
        f"most waiting at once {max(x['max_waiting'] for x in st)}, most running {max(x['max_running'] for x in st)}, "
        f"mean decode batch {sum(x['batch_s'] for x in st) / max(1e-9, sum(x['decode_s'] for x in st)):.0f}, "
        f"mean KV in use {sum(x['kv_token_s'] for x in st) / max(1e-9, sum(e['now_s'] for e in r.engine_stats)) / 1e3:.0f}k tokens"
    )


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--engines", type=int, default=16, help="engines of the main table (default: %(default)s)"
    )
    ap.add_argument(
        "--scaling",
        default="4,16,64",
        help="engine counts of the scaling rows ('' for none; default: %(default)s)",
    )
    ap.add_argument(
        "--duration-s", type=float, default=150.0, help="modelled seconds per run (default: %(default)s)"
    )
    ap.add_argument("--warmup-s", type=float, default=50.0, help="modelled seconds left out of the window")
    ap.add_argument(
        "--time-scale",
        default="4:1,16:2,64:4",
        help="wall seconds per modelled second: one number, or ENGINES:SCALE pairs (others: engines/16, "
        "at least 1; default: %(default)s)",
    )
    ap.add_argument(
        "--policies", default=",".join((*ROUTER_POLICIES, *PLACEMENTS)), help="rows of the main table"
    )
    ap.add_argument(
        "--scaling-policies",
        default="cache_aware,consistent_hashing,placement",
        help="rows of each scaling size (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument(
        "--trace", help="replay this trace (bench/routing_trace.py format or a gateway routing record)"
    )
    ap.add_argument("--scale", type=int, default=1, help="with --trace: copies of each recorded group")
    ap.add_argument(
        "--length-scale", type=float, default=1.0, help="with --trace: token counts multiplied by this"
    )
    ap.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE", help="simulated-engine parameter"
    )
    ap.add_argument("--swe-per-engine", type=float, default=16.0, help="swe sessions in flight per engine")
    ap.add_argument(
        "--harness-per-engine", type=float, default=12.0, help="harness sessions in flight per engine"
    )
    ap.add_argument("--math-groups-per-engine", type=float, default=2.0)
    ap.add_argument("--step-s", type=float, default=30.0)
    args = ap.parse_args()
    params = sim_engine._parse_overrides(args.param)

    def trace_for(n: int) -> tuple[list[routing_trace.Group], dict[str, int], str]:
        if args.trace:
            groups, caps = _load_trace(args.trace)
            groups = routing_trace.scaled(groups, args.scale, args.length_scale)
            caps = {k: v * args.scale for k, v in caps.items()}
            return groups, caps, f"recorded {args.trace} x{args.scale} (lengths x{args.length_scale})"
        groups, caps = routing_trace.generate(
            n,
            duration_s=args.duration_s,
            step_s=args.step_s,
            math_groups_per_engine=args.math_groups_per_engine,
            swe_per_engine=args.swe_per_engine,
            harness_per_engine=args.harness_per_engine,
            seed=args.seed,
        )
        return groups, caps, f"generated (seed {args.seed})"

    def run_all(n: int, policies: list[str]) -> list[RunResult]:
        groups, caps, what = trace_for(n)
        ts = _time_scale(args.time_scale, n)
        print(
            f"\n== {n} simulated engines; trace {what}: {len(groups)} groups, "
            f"{sum(len(g.sessions) for g in groups)} sessions, caps {caps}; {args.duration_s:g} s modelled per "
            f"policy, window {args.warmup_s:g}-{args.duration_s:g} s; time scale {ts:g}",
            flush=True,
        )
        out = []
        for p in policies:
            r = run_policy(
                p, groups, caps, engines=n, duration_s=args.duration_s, warmup_s=args.warmup_s,
                time_scale=ts, sim_procs=max(1, min(4, n // 8)), sim_params=params,
            )  # fmt: skip
            print_costs(r, ts)
            print(f"  [{r.policy}] {row(r)}", flush=True)  # the row now: a run stopped later keeps it
            out.append(r)
        return out

    started = time.monotonic()
    main_results = run_all(args.engines, args.policies.split(","))
    print()
    print_table(main_results)
    scaling = [int(x) for x in args.scaling.split(",") if x.strip()]
    rows: list[tuple[int, list[RunResult]]] = []
    for n in scaling:
        if n == args.engines:
            keep = set(args.scaling_policies.split(","))
            rows.append((n, [r for r in main_results if r.policy in keep]))
        else:
            rows.append((n, run_all(n, args.scaling_policies.split(","))))
    if rows:
        print(
            "\nscaling (same trace shape per engine; ratios against the best router-only policy at that size):"
        )
        print(
            f"{'engines':>8}  {'policy':<22}{'tokens/s':>10}{'x best':>8}{'p50 turn s':>12}{'p99 turn s':>12}"
            f"{'x best p99':>12}{'hit rate':>10}{'load max/mean':>15}{'moved':>8}"
        )
        for n, rs in rows:
            best = max((r for r in rs if r.policy in ROUTER_POLICIES), key=lambda r: r.tokens_per_s())
            for r in rs:
                print(
                    f"{n:>8}  {r.policy:<22}{r.tokens_per_s():>10.0f}{_ratio(r.tokens_per_s(), best.tokens_per_s()):>8.2f}"
                    f"{_fmt(r.pct(0.5)):>12}{_fmt(r.pct(0.99)):>12}{_ratio(r.pct(0.99), best.pct(0.99)):>12.2f}"
                    f"{_fmt(r.hit_rate(), 3):>10}{_fmt(r.load_max_over_mean()):>15}{r.moved_sessions():>8}"
                )
    print(f"\nbench wall time {time.monotonic() - started:.0f} s")
    return 0


def _time_scale(spec: str, engines: int) -> float:
    if ":" not in spec:
        return float(spec)
    pairs = dict(item.split(":") for item in spec.split(",") if item.strip())
    return float(pairs.get(str(engines), max(1.0, engines / 16)))


def _load_trace(path: str) -> tuple[list[routing_trace.Group], dict[str, int]]:
    """A trace file, or a gateway routing record (one call per line), converted on the fly."""
    with open(path) as f:
        first = next((line for line in f if line.strip()), "")
    row = orjson.loads(first) if first else {}
    if "caps" in row or "sessions" in row:
        return routing_trace.read(path)
    return routing_trace.convert_record(routing_trace._lines(path))


if __name__ == "__main__":
    import signal

    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the engines and the router are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
