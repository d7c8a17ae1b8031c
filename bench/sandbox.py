"""Sandbox exec benchmark, one run, ratios: warm-exec latency and throughput per backend.

    .venv/bin/python -m bench.sandbox [--execs 200] [--rounds 4] [--cmd echo ok]
                                      [--compose-url http://127.0.0.1:8100 --compose-key KEY]

For each backend, 8 warm sandboxes from a pool; the same command is run at concurrency 1 (one
sandbox, one exec after another) and 8 (eight sandboxes, each running execs back to back):
* floor: plain ``subprocess.run`` of the command on the host (8 threads for concurrency 8);
* local: bubblewrap (sandbox/local.py);
* remote: an exec server (``python -m palaestra.sandbox serve``, local backend) on loopback, over HTTP;
* docker: containers on the local engine (sandbox/docker.py), when an engine answers;
* compose: the compose fleet (docker-compose.yml: exec-server replicas with no network behind the
  loopback front); brought up for the run (``docker compose up --wait``, ``down`` after) where an
  engine answers, unless ``--compose-url`` (or $PALAESTRA_COMPOSE_SANDBOX_URL) points at a running one.
Backends that cannot run here are listed with the reason. At concurrency 1 the backends take turns
exec by exec, at 8 block by block over ``--rounds``, so that load from other work on the machine
hits them alike (execs/s at concurrency 1 is then 1 / mean latency). Printed per backend:
p50/p99 latency and execs/s at both concurrencies, and p50 as a multiple of the floor's. Goal: local
warm exec p50 <= 15 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench import common
from palaestra.net import ServerProcess, free_port
from palaestra.sandbox import Backend, Limits, SandboxError, SandboxPool
from palaestra.sandbox.local import LocalBackend

CONCURRENCY = (1, 8)  # the loop in bench() knows these two
LABEL = "palaestra-bench"
LOCAL_GOAL_P50_MS = 15.0


@dataclass
class Series:
    """Latencies and wall time of one (backend, concurrency) pair, summed over rounds."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0

    def add(self, latencies: list[float], wall: float) -> None:
        self.latencies += latencies
        self.wall += wall

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall


@dataclass
class Runner:
    """One backend's way to run the command: once (``one``) or ``n`` times from ``c`` workers (``block``)."""

    one: Callable[[], Awaitable[float]]
    block: Callable[[int, int], Awaitable[tuple[list[float], float]]]


def floor_runner(cmd: list[str]) -> Runner:
    def run_once() -> float:
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0

    async def one() -> float:
        return run_once()

    async def block(concurrency: int, execs: int) -> tuple[list[float], float]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(lambda _: run_once(), range(execs)))
        return latencies, time.perf_counter() - t0

    return Runner(one, block)


async def pool_runner(pool: SandboxPool, cmd: list[str]) -> Runner:
    own = await pool.acquire()  # concurrency 1 runs here; the block borrows the other sandboxes

    async def timed(box) -> float:
        t0 = time.perf_counter()
        result = await box.exec(cmd)
        if not result.ok:
            raise SandboxError(f"benchmark command failed: {result}")
        return time.perf_counter() - t0

    async def one() -> float:
        return await timed(own)

    async def worker(box, n: int, out: list[float]) -> None:
        for _ in range(n):
            out.append(await timed(box))

    async def block(concurrency: int, execs: int) -> tuple[list[float], float]:
        boxes = [own] + [await pool.acquire() for _ in range(concurrency - 1)]
        latencies: list[float] = []
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(b, execs // concurrency, latencies) for b in boxes))
            wall = time.perf_counter() - t0
        finally:
            for b in boxes[1:]:
                await pool.release(b)
        return latencies, wall

    return Runner(one, block)


async def open_backends(args, server_url: str, key: str) -> tuple[dict[str, Backend], dict[str, str]]:
    """The backends that can run here, and why the others cannot."""
    from palaestra.sandbox.remote import RemoteBackend

    backends: dict[str, Backend] = {
        "local": LocalBackend(label=LABEL),
        "remote": RemoteBackend(url=server_url, api_key=key, label=LABEL),
    }
    skipped: dict[str, str] = {}
    try:
        from palaestra.sandbox.docker import DockerBackend
    except ImportError as exc:
        skipped["docker"] = f"no docker backend in this tree ({exc})"
    else:
        try:
            backends["docker"] = DockerBackend(label=LABEL)
            await (await backends["docker"].create("python", Limits())).close()
        except Exception as exc:  # no engine, no image: say so and go on
            backends.pop("docker", None)
            skipped["docker"] = f"{type(exc).__name__}: {exc}"
    if args.compose_url:
        backends["compose"] = RemoteBackend(url=args.compose_url, api_key=args.compose_key, label=LABEL)
    else:
        skipped["compose"] = (
            "no compose exec server given (`docker compose up -d`, then --compose-url URL --compose-key KEY)"
        )
    return backends, skipped


async def bench(args, server_url: str, key: str) -> None:
    cmd = args.cmd
    backends, skipped = await open_backends(args, server_url, key)
    runners: dict[str, Runner] = {"floor": floor_runner(cmd)}
    pools: list[SandboxPool] = []
    for name, backend in backends.items():
        try:
            pool = await SandboxPool(
                backend, size=max(CONCURRENCY), limits=Limits(), cleanup_on_start=False
            ).start()
        except (SandboxError, OSError) as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        pools.append(pool)
        runners[name] = await pool_runner(pool, cmd)
    try:
        for runner in runners.values():  # warm-up: first execs, connections, page cache
            await runner.block(8, 16)
        results = {(name, c): Series() for name in runners for c in CONCURRENCY}
        per_round = max(8, args.execs // args.rounds)
        for _ in range(args.rounds):
            # Concurrency 1: one exec per backend in turn, so that load from other work on the
            # machine hits every backend alike; concurrency 8: a block per backend.
            for _ in range(per_round):
                for name, runner in runners.items():
                    latency = await runner.one()
                    results[name, 1].add([latency], latency)
            for name, runner in runners.items():
                results[name, 8].add(*await runner.block(8, per_round))
    finally:
        for pool in pools:
            await pool.close()
        for backend in backends.values():
            await backend.close()
    report(results, runners, skipped, cmd, args)


def report(results, runners, skipped, cmd, args) -> None:
    print(
        f"command: {' '.join(cmd)}; {args.rounds} rounds; {os.cpu_count()} CPUs; loadavg {os.getloadavg()[0]:.1f}"
    )
    head = f"{'backend':<8}" + "".join(
        f" | c={c}: {'p50 ms':>7} {'p99 ms':>7} {'execs/s':>8} {'p50/floor':>9}" for c in CONCURRENCY
    )
    print(head)
    print("-" * len(head))
    for name in runners:
        row = f"{name:<8}"
        for c in CONCURRENCY:
            s, floor = results[name, c], results["floor", c]
            row += f" | {'':4}{s.p(0.5):7.2f} {s.p(0.99):7.2f} {s.rate:8.1f} {s.p(0.5) / floor.p(0.5):8.1f}x"
        print(row)
    for name, why in skipped.items():
        print(f"{name:<8} | not run: {why}")
    if "local" in runners:
        p50 = results["local", 1].p(0.5)
        verdict = "met" if p50 <= LOCAL_GOAL_P50_MS else "NOT met"
        print(f"goal local warm exec p50 <= {LOCAL_GOAL_P50_MS:g} ms: {verdict} ({p50:.2f} ms)")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--execs", type=int, default=200, help="execs per backend and concurrency, over all rounds"
    )
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    ap.add_argument("--cmd", nargs="+", default=["echo", "ok"], help="the command every exec runs")
    ap.add_argument("--compose-url", default=os.environ.get("PALAESTRA_COMPOSE_SANDBOX_URL"))
    ap.add_argument("--compose-key", default=os.environ.get("PALAESTRA_SANDBOX_API_KEY"))
    ap.add_argument(
        "--no-compose-up",
        action="store_true",
        help="without --compose-url, do not bring the compose fleet up for the run",
    )
    args = ap.parse_args()
    key = secrets.token_hex(16)
    port = free_port()
    argv = [sys.executable, "-m", "palaestra.sandbox", "serve", "--port", str(port), "--label", LABEL]
    with contextlib.ExitStack() as stack:
        if not args.compose_url and not args.no_compose_up:
            args.compose_url, args.compose_key = stack.enter_context(compose_fleet_for_bench())
        server = stack.enter_context(
            ServerProcess(
                argv,
                f"http://127.0.0.1:{port}",
                name="sandbox-server",
                env={"PALAESTRA_SANDBOX_API_KEY": key},
            )
        )
        asyncio.run(bench(args, server.url, key))


@contextlib.contextmanager
def compose_fleet_for_bench():
    """The docker-compose.yml fleet (2 replicas) on a free loopback port for this run, where a docker
    engine answers; (None, None) otherwise (the compose row then says why it did not run)."""
    try:
        import docker

        from palaestra.sandbox.fleet import FleetError, running_fleet
        from palaestra.sandbox.images import build

        client = docker.from_env()
        client.ping()
        build.ensure_image(client, "server")
    except Exception as exc:  # no SDK, no engine, no image: the report says so
        print(f"compose fleet not started: {type(exc).__name__}: {exc}", file=sys.stderr)
        yield None, None
        return
    key = secrets.token_hex(16)
    compose_file = Path(__file__).resolve().parents[1] / "docker-compose.yml"
    try:
        with running_fleet(
            compose_file, api_key=key, port=free_port(), project="palaestra-bench", label=LABEL
        ) as url:
            yield url, key
    except FleetError as exc:
        print(f"compose fleet not started: {exc}", file=sys.stderr)
        yield None, None


if __name__ == "__main__":
    main()
