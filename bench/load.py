"""Gateway load benchmark, one run: sessions/s, per-call latency and the gateway's memory at 10, 100
and 1,000 concurrent sessions, with the ratios between them.

    .venv/bin/python -m bench.load [--levels 10 100 1000] [--turns 3]

A `palaestra gateway serve` subprocess (the `tiny` preset's tokenizer) over the zero-work engine
(`palaestra.testing.zero`, alphabet mode), both on 127.0.0.1, so only the gateway is measured. At
each level, that many agents (tests/support/load_agents.py, the same ones tests/gateway/test_load.py verifies) open
their sessions, all before the first turn, chat `--turns` turns each and reward them; each agent
checks every answer is the one its engine produced for its session. Each level runs two such
rounds. Printed per level, from the second round: sessions/s (sessions / the round's wall time,
session creation and reward included) and p50/p99 of the chat calls' latency as the agents
measured it; the gateway's RSS before the level, at its peak (read from /proc every 20 ms) and
after it; and the RSS the second round added per session: what a finished session keeps once the
first round has sized the allocator's pools (freed memory stays with the process for reuse, so
the RSS after a level is about its peak). The driver, the engine and the gateway share the
machine's cores, so the latency at 1,000 sessions is mostly queueing: read the ratios, not the
absolute times. Stops by itself; the spool goes to a temporary directory that is removed.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass

from bench import common
from palaestra.gateway.cli import gateway_process
from tests.support.load_agents import (
    ZeroReplies,
    fds_needed,
    peak_rss_while,
    raise_fd_limit,
    rss_kib,
    run_agents,
)

KEY = "bench"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ENV = {"PALAESTRA_API_KEY": KEY, "PALAESTRA_ADMIN_KEY": "bench-admin"}


@dataclass
class Level:
    sessions: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    rss_before: int
    rss_peak: int
    rss_first: int
    """After the level's first round."""
    rss_after: int
    """After its second round."""

    @property
    def rate(self) -> float:
        return self.sessions / self.wall_s

    @property
    def kept_bytes(self) -> float:
        """RSS the second round added per session (see the module docstring)."""
        return (self.rss_after - self.rss_first) * 1024 / self.sessions


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_round(url: str, pid: int, n: int, turns: int, replies: ZeroReplies) -> tuple[list[float], float, int]:
    """One round of `n` agents: their chat calls' latencies, the wall time and the gateway's peak RSS."""
    work = run_agents(url, HEADERS, n, turns, f"c{n}x", replies)
    (records, wall), peak = asyncio.run(peak_rss_while(pid, work))
    time.sleep(1.0)  # connections close, the last spool writes return
    return [s for r in records for s in r.latencies], wall, peak


def run_level(url: str, pid: int, n: int, turns: int, replies: ZeroReplies) -> Level:
    """Two rounds of `n` sessions: the timings of the second, the RSS around both."""
    before = rss_kib(pid)
    _, _, peak1 = run_round(url, pid, n, turns, replies)
    first = rss_kib(pid)
    latencies, wall, peak2 = run_round(url, pid, n, turns, replies)
    p50, p99 = statistics.median(latencies) * 1e3, percentile(latencies, 0.99) * 1e3
    return Level(n, wall, p50, p99, before, max(peak1, peak2), first, rss_kib(pid))


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--levels", type=int, nargs="+", default=[10, 100, 1000], help="concurrent sessions")
    ap.add_argument("--turns", type=int, default=3, help="chat turns per session")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    needed = fds_needed(max(args.levels))
    soft = raise_fd_limit(needed)
    if soft < needed:
        raise SystemExit(
            f"RLIMIT_NOFILE hard limit {soft} < {needed}: raise it (ulimit -Hn) or lower --levels"
        )
    replies = ZeroReplies.for_tokenizer(AutoTokenizer.from_pretrained(resolve_model("tiny")))
    with (
        tempfile.TemporaryDirectory(prefix="palaestra-bench-load-") as spool,
        replies.engine() as engine,
        gateway_process("tiny", engine.url, spool, env=ENV) as gw,
    ):
        assert gw.pid is not None
        run_round(gw.url, gw.pid, 10, args.turns, replies)  # warm-up: first-use caches, imports
        idle = rss_kib(gw.pid)
        levels = [run_level(gw.url, gw.pid, n, args.turns, replies) for n in args.levels]

    mib = 1 / 1024
    print(
        f"gateway over the zero-work engine, {args.turns} chat turns per session; idle RSS {idle * mib:.1f} MiB"
    )
    print("sessions  sessions/s  p50 ms  p99 ms  RSS before / peak / after (MiB)  kept per finished session")
    for lv in levels:
        rss = f"{lv.rss_before * mib:.1f} / {lv.rss_peak * mib:.1f} / {lv.rss_after * mib:.1f}"
        print(
            f"{lv.sessions:>8}  {lv.rate:>10.1f}  {lv.p50_ms:>6.1f}  {lv.p99_ms:>6.1f}  {rss:>31}  "
            f"{lv.kept_bytes:>10.0f} B"
        )
    base = levels[0]
    for lv in levels[1:]:
        print(
            f"{lv.sessions} vs {base.sessions} sessions: sessions/s {lv.rate / base.rate:.2f}x, "
            f"p50 {lv.p50_ms / base.p50_ms:.2f}x, p99 {lv.p99_ms / base.p99_ms:.2f}x, peak RSS over idle "
            f"{(lv.rss_peak - idle) * mib:.1f} MiB vs {(base.rss_peak - idle) * mib:.1f} MiB "
            f"({(lv.rss_peak - idle) / max(base.rss_peak - idle, 1):.1f}x)"
        )


if __name__ == "__main__":
    main()
