"""Gateway shard scaling, one run: turns/s and p99 added latency vs concurrent sessions, for one
gateway, one gateway behind a front, and 2 shards behind a front.

    .venv/bin/python -m bench.shards [--levels 16 64 256] [--turns 4] [--shards 1 2]

Every layout runs over the zero-work engine (`palaestra.testing.zero`, alphabet mode: an answer
costs the engine nothing), so what saturates is the gateway: a chat call's latency as the agent
measures it is the gateway's added latency (plus one local HTTP hop to the engine). At each level
that many agents (tests/support/load_agents.py, the agents tests/gateway/test_load.py verifies)
open their sessions, all before the first turn, chat `--turns` turns each and reward them; each
checks every answer is the one its engine produced for its session. Two rounds per level; the
second is measured. Printed per layout and level: chat turns/s (the round's chat turns / its wall
time, session creation and reward included), p50/p99 of the chat calls' latency, and the CPU
seconds per turn of the gateway processes (the front and every shard, from /proc); then the
ratios of each layout to one gateway, and per layout where its turns/s peaked and its
ceiling on paper with a core per process (from the CPU per turn). Then, per layout, the CPU per
turn of each process below saturation (``--calm`` sessions at a time per shard, 2 by default, rounds of them
until ``--calm-turns`` turns, the layouts' rounds alternating so that a load from outside the bench
falls on each alike: the processes mostly take turns, so the figures are not inflated by
processes waiting for a core, as they are at the levels above on a machine with fewer cores than
processes; every layout's processes are up from the start), the ceiling it allows with a core per process (the busiest process's core full), and
``2 shards / 1 gateway on paper = ...`` from it and from each level's CPU per turn.
Layouts: ``1`` = one `palaestra gateway serve`;
``1+front`` = the same behind `palaestra gateway front` (what the front's hop costs);
``2`` = two shards behind a front (gateway/shards.py).

The driver, the engine, the front and the shards share the machine's cores: on a 2-core machine
two shards cannot run in parallel with the driver and the front, so the 2-shard rows there show
the cost of the extra hop more than the scaling; the CPU per turn says what the front adds and
what a core per shard would allow. Run it where each process has its own core for the scaling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

from palaestra.gateway.shards import GatewayFleet, front_process
from palaestra.net import ServerProcess
from tests.support.load_agents import ZeroReplies, fds_needed, raise_fd_limit, run_agents

KEY = "bench"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ENV = {"PALAESTRA_API_KEY": KEY, "PALAESTRA_ADMIN_KEY": "bench-admin"}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """CPU seconds of `pids` so far: each thread's time on a core (/proc/<pid>/task/*/schedstat, in
    nanoseconds), or, where the kernel keeps no schedstat, user + system (/proc/<pid>/stat, in clock
    ticks: 10 ms)."""
    total = 0.0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            total += sum(int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0]) for t in tasks) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Row:
    layout: str
    sessions: int
    turns: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_turn: float  # the front's and every shard's
    front_cpu_ms_per_turn: float

    @property
    def rate(self) -> float:
        return self.turns / self.wall_s


def measure(
    layout: str, url: str, shards: list[int], fronts: list[int], n: int, turns: int, replies: ZeroReplies
) -> Row:
    asyncio.run(run_agents(url, HEADERS, n, turns, f"w{n}", replies))  # warm: pools, caches
    time.sleep(0.5)
    cpu0, front0 = cpu_s(shards + fronts), cpu_s(fronts)
    records, wall = asyncio.run(run_agents(url, HEADERS, n, turns, f"m{n}", replies))
    cpu, front = cpu_s(shards + fronts) - cpu0, cpu_s(fronts) - front0
    lat = [s for r in records for s in r.latencies]
    p50, p99 = statistics.median(lat) * 1e3, percentile(lat, 0.99) * 1e3
    return Row(layout, n, len(lat), wall, p50, p99, cpu * 1e3 / len(lat), front * 1e3 / len(lat))


def core_ceiling(shards: int, shard_ms: float, front_ms: float) -> tuple[float, str]:
    """Turns/s with a core per process and what bounds it (``"shards"`` or ``"front"``): each of
    `shards` shards serves its share of the turns (`shards x 1000 / shard_ms`, `shard_ms` a shard's
    CPU per turn of its own) and the front serves all of them (`1000 / front_ms`; 0: no front)."""
    ceilings = {"shards": shards * 1000 / shard_ms if shard_ms > 0 else float("inf")}
    if front_ms > 0:
        ceilings["front"] = 1000 / front_ms
    bound = min(ceilings, key=ceilings.__getitem__)
    return ceilings[bound], bound


@dataclass
class Calm:
    """A layout's CPU per turn below saturation: `sessions` agents at a time, rounds of them until
    `turns` chat turns; each process's CPU over all the layout's turns (a shard's share of the
    fleet's turns, not of its own)."""

    layout: str
    sessions: int
    turns: int
    wall_s: float
    front_ms: float
    shard_ms: list[float]

    @property
    def per_shard_ms(self) -> float:
        """CPU per turn of a shard for its own turns, the shards sharing the turns evenly (as many
        sessions do; the bench's few hundred split by chance, a few % off even)."""
        return sum(self.shard_ms)

    @property
    def ceiling(self) -> float:
        """Turns/s with a core per process: the shards' cores or the front's full, whichever first."""
        return core_ceiling(len(self.shard_ms), self.per_shard_ms, self.front_ms)[0]

    @property
    def bound(self) -> str:
        return "the " + core_ceiling(len(self.shard_ms), self.per_shard_ms, self.front_ms)[1]


class Layout:
    """One layout's processes (its shards and, but for ``1``, a front) while in its `with`."""

    def __init__(self, layout: str, engine_url: str):
        self.name = layout
        self.spool = tempfile.TemporaryDirectory(prefix="palaestra-bench-shards-")
        shards = 1 if layout.startswith("1") else int(layout)
        self.fleet = GatewayFleet("tiny", engine_url, self.spool.name, shards, env=ENV)
        self.extra_front: ServerProcess | None = None

    def __enter__(self) -> Layout:
        try:
            self.fleet.__enter__()
            if self.name == "1+front":
                self.extra_front = front_process([self.fleet.shards[0].url])
                self.extra_front.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.extra_front is not None:
            self.extra_front.stop()
        self.fleet.stop()
        self.spool.cleanup()

    @property
    def url(self) -> str:
        return (self.extra_front or self.fleet).url

    @property
    def shard_pids(self) -> list[int]:
        return [p.pid for p in self.fleet.shards if p.pid is not None]

    @property
    def front_pids(self) -> list[int]:
        fronts = (self.fleet.front, self.extra_front)
        return [p.pid for p in fronts if p is not None and p.pid is not None]


def measure_calm(layouts: list[Layout], n: int, turns: int, replies: ZeroReplies, least: int) -> list[Calm]:
    """CPU per turn of each process of each layout with `n` sessions at a time per shard (so each
    gateway process has as many calls in flight in every layout: a process's CPU per call falls
    with how many it serves at once, each wake-up of its loop serving more; `n` is far below where
    the processes saturate: they mostly take turns, so none is measured while it waits for a core),
    rounds of them until each layout served at least `least` chat turns. The layouts' rounds
    alternate, so a load from outside the bench that comes and goes falls on each alike; CPU times
    are exact to a nanosecond, a round's share of a turn is not, hence many rounds."""
    for lay in layouts:
        asyncio.run(run_agents(lay.url, HEADERS, n * len(lay.shard_pids), turns, f"cw{n}", replies))
    time.sleep(0.5)
    pids = [[*lay.front_pids, *lay.shard_pids] for lay in layouts]
    before = [[cpu_s([p]) for p in own] for own in pids]
    done, wall = [0] * len(layouts), [0.0] * len(layouts)
    round_ = 0
    while min(done) < least:
        for k, lay in enumerate(layouts):
            each = n * len(lay.shard_pids)
            records, seconds = asyncio.run(
                run_agents(lay.url, HEADERS, each, turns, f"c{n}-{round_}", replies)
            )
            done[k] += sum(len(r.latencies) for r in records)
            wall[k] += seconds
        round_ += 1
    out = []
    for k, lay in enumerate(layouts):
        ms = [(cpu_s([p]) - b) * 1e3 / done[k] for p, b in zip(pids[k], before[k], strict=True)]
        fronts = len(lay.front_pids)
        out.append(Calm(lay.name, n * len(lay.shard_pids), done[k], wall[k], sum(ms[:fronts]), ms[fronts:]))
    return out


def main() -> None:
    from bench import common  # the training stack it imports: not for the arithmetic's tests

    ap = common.parser(__doc__)
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 64, 256], help="concurrent sessions")
    ap.add_argument("--turns", type=int, default=4, help="chat turns per session")
    ap.add_argument(
        "--layouts", nargs="+", default=["1", "1+front", "2"], help="1, 1+front, or a shard count (2, 4, ...)"
    )
    ap.add_argument(
        "--calm",
        type=int,
        default=2,
        help="sessions at a time per shard for the CPU per turn below saturation (0: not measured)",
    )
    ap.add_argument("--calm-turns", type=int, default=512, help="chat turns measured below saturation")
    args = ap.parse_args()
    if args.calm < 0 or args.calm_turns < 1:
        raise SystemExit(
            f"--calm must be 0 or more and --calm-turns 1 or more (got {args.calm}, {args.calm_turns})"
        )

    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    needed = 2 * fds_needed(max(args.levels))
    if raise_fd_limit(needed) < needed:
        raise SystemExit(f"RLIMIT_NOFILE hard limit below {needed}: raise it (ulimit -Hn) or lower --levels")
    replies = ZeroReplies.for_tokenizer(AutoTokenizer.from_pretrained(resolve_model("tiny")))
    rows: list[Row] = []
    with replies.engine() as engine, contextlib.ExitStack() as stack:
        layouts = [stack.enter_context(Layout(name, engine.url)) for name in args.layouts]
        for lay in layouts:
            rows += [
                measure(lay.name, lay.url, lay.shard_pids, lay.front_pids, n, args.turns, replies)
                for n in args.levels
            ]
        calms = measure_calm(layouts, args.calm, args.turns, replies, args.calm_turns) if args.calm else []

    print(f"gateway layouts over the zero-work engine, {args.turns} chat turns per session; {common_load()}")
    print("layout    sessions  turns/s  p50 ms  p99 ms  CPU ms/turn: all gateway processes  of it the front")
    for r in rows:
        print(
            f"{r.layout:<8}  {r.sessions:>8}  {r.rate:>7.1f}  {r.p50_ms:>6.1f}  {r.p99_ms:>6.1f}  "
            f"{r.cpu_ms_per_turn:>34.2f}  {r.front_cpu_ms_per_turn:>14.2f}"
        )
    print_saturation(rows, args.layouts)
    print_calm(calms, args.turns)
    print_on_paper(rows, calms)
    base = {r.sessions: r for r in rows if r.layout == args.layouts[0]}
    for r in rows:
        if r.layout != args.layouts[0] and r.sessions in base:
            b = base[r.sessions]
            print(
                f"{r.layout} vs {b.layout} at {r.sessions} sessions: turns/s {r.rate / b.rate:.2f}x, "
                f"p99 {r.p99_ms / b.p99_ms:.2f}x, CPU per turn {r.cpu_ms_per_turn / b.cpu_ms_per_turn:.2f}x"
            )


def print_saturation(rows: list[Row], layouts: list[str]) -> None:
    """Per layout: the level after which turns/s stopped growing (no higher level 10 % above it: the
    processes are saturated on this machine), and the ceiling on paper with a core per process,
    from the CPU per turn measured at the highest level: each shard serves its share of the turns
    (`shards x 1000 / shard ms`) and the front serves all of them (`1000 / front ms`)."""
    for layout in layouts:
        own = sorted((r for r in rows if r.layout == layout), key=lambda r: r.sessions)
        if not own:
            continue
        # the last level before which no higher level gained 10 %: where this machine saturated
        flat = next(
            (own[j - 1] for j in range(1, len(own)) if max(r.rate for r in own[j:]) < 1.1 * own[j - 1].rate),
            None,
        )
        top = own[-1]
        shards = 1 if layout.startswith("1") else int(layout)
        shard_ms = top.cpu_ms_per_turn - top.front_cpu_ms_per_turn
        ceiling, bound = core_ceiling(shards, shard_ms, top.front_cpu_ms_per_turn)
        print(
            f"{layout}: turns/s "
            + (
                f"peaked at {flat.sessions} sessions ({flat.rate:.1f}/s; no higher level gained 10 %)"
                if flat
                else f"still growing at {top.sessions} sessions ({top.rate:.1f}/s)"
            )
            + f"; with a core per process: {ceiling:.0f} turns/s, bound by the {bound} "
            f"({shard_ms:.2f} ms per turn in the shards"
            + (f", {top.front_cpu_ms_per_turn:.2f} ms in the front" if top.front_cpu_ms_per_turn > 0 else "")
            + f", at {top.sessions} sessions)"
        )


def print_calm(calms: list[Calm], turns: int) -> None:
    """Each layout's CPU per turn below saturation, per process, and its ceiling with a core each."""
    if not calms:
        return
    per = calms[0].sessions // max(1, len(calms[0].shard_ms))
    print(
        f"CPU per turn below saturation ({per} sessions at a time per shard, {turns} chat turns each, "
        "rounds of them, the layouts alternating; each process's CPU / all the layout's turns):"
    )
    print(
        "layout  sessions  turns  turns/s  front ms  shards' ms (each)  a shard's own turn  with a core per process"
    )
    for c in calms:
        front = f"{c.front_ms:.2f}" if c.front_ms > 0 else "-"
        shards = " ".join(f"{m:.2f}" for m in c.shard_ms)
        print(
            f"{c.layout:<6}  {c.sessions:>8}  {c.turns:>5}  {c.turns / c.wall_s:>7.1f}  {front:>8}  {shards:<17}  "
            f"{c.per_shard_ms:>18.2f}  {c.ceiling:.0f} turns/s, bound by {c.bound}"
        )


def paper_ceiling(layout: str, row: Row) -> float:
    """`print_saturation`'s ceiling of a measured level: the shards split the turns evenly."""
    shards = 1 if layout.startswith("1") else int(layout)
    return core_ceiling(shards, row.cpu_ms_per_turn - row.front_cpu_ms_per_turn, row.front_cpu_ms_per_turn)[0]


def print_on_paper(rows: list[Row], calms: list[Calm]) -> None:
    """`N shards / 1 gateway on paper`: the ceilings' ratio, below saturation (the CPU per turn not
    inflated by processes waiting for the machine's cores) and at each level measured."""
    one = next((c for c in calms if c.layout == "1"), None)
    for c in calms:
        if one is not None and not c.layout.startswith("1"):
            print(
                f"{c.layout} shards / 1 gateway on paper = {c.ceiling / one.ceiling:.2f}x "
                f"(below saturation: {c.ceiling:.0f} / {one.ceiling:.0f} turns/s)"
            )
    base = {r.sessions: r for r in rows if r.layout == "1"}
    for r in rows:
        if not r.layout.startswith("1") and r.sessions in base:
            ratio = paper_ceiling(r.layout, r) / paper_ceiling("1", base[r.sessions])
            print(
                f"{r.layout} shards / 1 gateway on paper = {ratio:.2f}x (from the CPU per turn at {r.sessions} sessions)"
            )


def common_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} (1 min) {five:.1f} (5 min)"


if __name__ == "__main__":
    main()
