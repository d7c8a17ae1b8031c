"""Traces of rollout traffic for bench/routing.py: generated from our environments' shapes, or recorded.

    .venv/bin/python -m bench.routing_trace generate --engines 16 --out runs/routing-trace.jsonl
    .venv/bin/python -m bench.routing_trace convert runs/demo-routing.jsonl --out runs/recorded-trace.jsonl

A trace is JSONL, one **group** per line (a GRPO group: sessions that start from the same prompt):

    {"group": "swe-0003", "env": "swe", "release_s": 0.0, "env_prefix": 3000, "group_prefix": 900,
     "sessions": [{"session": "swe-0003-0",
                   "turns": [{"new": 12, "out": 180, "gap_s": 0.0}, {"new": 640, "out": 95, "gap_s": 1.3}]}]}

Turn 0's prompt is the environment's shared prefix (system prompt, tool schemas: `env_prefix`
tokens, the same for every session of the env), then the group's task (`group_prefix` tokens, the
same for the group), then `new` tokens of the session's own; every later turn's prompt is the
previous prompt + the engine's answer (`out` tokens) + `new` tokens (tool output, user message),
sent `gap_s` seconds (tool time) after the answer. `release_s` is when the group may start (a burst
when a training step starts); the replay also caps how many sessions of each env run at once, as
a rollout runner's concurrency limit does.

`generate` mixes what our environments do (the shapes below, not measured from them):

| env | like | group | turns | env prefix | per turn out | per turn new (tool output) | gap |
|---|---|---|---|---|---|---|---|
| `math` | environments/math | 8 | 1-3 | 400 | 200-700, later 40-200 | 20-60 | 0.02-0.1 s |
| `swe` | environments/swe_agent | 4 | 20-60 | 3,000 | 60-300 | lognormal, median 600 (50-6,000) | 0.3-2 s |
| `harness` | an external CLI agent harness | 4 | 4-15 | 9,000 | 150-600 | lognormal, median 300 (20-3,000) | 0.2-1 s |

`math` groups come in bursts, `--math-groups-per-engine` groups per engine every `--step-s`
seconds; `swe` and `harness` groups are all released at once and run `--swe-per-engine` /
`--harness-per-engine` sessions per engine at a time (constant populations of long sessions). The
first population of long sessions starts at a random point of its life (`start_turn`: the replay
builds the history up to that turn without calling the engine), so a run of a few minutes sees
the contexts of a steady state rather than a cluster that just started.

`convert` turns a gateway's routing record (`--routing-trace PATH`, docs/routing.md: one line per
engine call) into this format; `python -m bench.routing --trace` replays it, `--scale K` times over.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import common

__all__ = ["Group", "Session", "Turn", "convert_record", "generate", "read", "scaled", "write"]


@dataclass
class Turn:
    new: int  # tokens appended before this turn's call (turn 0: the session's own prompt tokens)
    out: int  # tokens the engine answers
    gap_s: float = 0.0  # wait after the previous answer (tool time) before this call


@dataclass
class Session:
    session: str
    turns: list[Turn]
    start_turn: int = 0  # > 0: the session is already running when the replay starts (see generate)


@dataclass
class Group:
    group: str
    env: str
    release_s: float
    env_prefix: int
    group_prefix: int
    sessions: list[Session] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(t.out for s in self.sessions for t in s.turns)


ENV_SHAPES = ("math", "swe", "harness")


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _math(rng: random.Random, name: str, release: float) -> Group:
    g = Group(name, "math", release, env_prefix=400, group_prefix=rng.randint(100, 400))
    for i in range(8):
        turns = [Turn(new=0, out=rng.randint(200, 700))]
        for _ in range(rng.randint(0, 2)):  # calculator calls
            turns.append(
                Turn(new=rng.randint(20, 60), out=rng.randint(40, 200), gap_s=rng.uniform(0.02, 0.1))
            )
        g.sessions.append(Session(f"{name}-{i}", turns))
    return g


def _tool_sessions(
    rng: random.Random, name: str, env: str, size: int, turns: tuple[int, int], prefix: int,
    task: tuple[int, int], out: tuple[int, int], tool_median: float, tool_range: tuple[int, int],
    gap: tuple[float, float],
) -> Group:  # fmt: skip
    g = Group(name, env, 0.0, env_prefix=prefix, group_prefix=rng.randint(*task))
    for i in range(size):
        n = rng.randint(*turns)
        ts = [Turn(new=rng.randint(0, 30), out=rng.randint(*out))]
        for _ in range(n - 1):
            ts.append(
                Turn(
                    new=_lognormal(rng, tool_median, 1.0, *tool_range),
                    out=rng.randint(*out),
                    gap_s=rng.uniform(*gap),
                )
            )
        g.sessions.append(Session(f"{name}-{i}", ts))
    return g


def generate(
    engines: int,
    *,
    duration_s: float = 300.0,
    step_s: float = 30.0,
    math_groups_per_engine: float = 2.0,
    swe_per_engine: float = 16.0,
    harness_per_engine: float = 12.0,
    seed: int = 0,
    steady: bool = True,
) -> tuple[list[Group], dict[str, int]]:
    """Groups for `engines` engines and about `duration_s` seconds, and the per-env caps (sessions
    in flight) to replay them with. Long-session envs get enough groups to keep their caps full."""
    rng = random.Random(seed)
    groups: list[Group] = []
    steps = max(1, int(duration_s // step_s) + 1)
    per_step = max(1, round(math_groups_per_engine * engines))
    for step in range(steps):
        for j in range(per_step):
            groups.append(_math(rng, f"math-{step:03d}-{j:03d}", step * step_s))
    caps = {
        "math": 8 * per_step,
        "swe": max(1, round(swe_per_engine * engines)),
        "harness": max(1, round(harness_per_engine * engines)),
    }
    # a swe session lasts ~40 turns x (~2 s turn + ~1 s tool) ~ 120 s; harness ~10 x 2 s ~ 20-30 s
    for env, life_s, size in (("swe", 100.0, 4), ("harness", 25.0, 4)):
        n_groups = max(1, math.ceil(caps[env] / size * (duration_s / life_s + 1)))
        initial = math.ceil(caps[env] / size)
        for j in range(n_groups):
            name = f"{env}-{j:04d}"
            if env == "swe":
                g = _tool_sessions(
                    rng, name, env, size, (20, 60), 3000, (500, 1500), (60, 300), 600, (50, 6000), (0.3, 2.0)
                )
            else:
                g = _tool_sessions(
                    rng, name, env, size, (4, 15), 9000, (200, 800), (150, 600), 300, (20, 3000), (0.2, 1.0)
                )
            if j < initial and steady:
                # the first population is already under way, at a random point of its life (the
                # groups of a step start together, so one age per group): the run starts in the
                # steady state of long sessions instead of with every context empty
                age = rng.random()
                for s in g.sessions:
                    s.start_turn = int(age * len(s.turns))
            groups.append(g)
    groups.sort(key=lambda g: (g.release_s, g.env, g.group))
    return groups, caps


def write(path: str | Path, groups: Iterable[Group], caps: dict[str, int]) -> None:
    """JSONL: a first line {"caps": {...}}, then one group per line."""
    with open(path, "w") as f:
        f.write(json.dumps({"caps": caps}) + "\n")
        for g in groups:
            f.write(json.dumps(asdict(g)) + "\n")


def read(path: str | Path) -> tuple[list[Group], dict[str, int]]:
    caps: dict[str, int] = {}
    groups: list[Group] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "caps" in row:
                    caps = {str(k): int(v) for k, v in row["caps"].items()}
                    continue
                sessions = [
                    Session(s["session"], [Turn(**t) for t in s["turns"]], int(s.get("start_turn", 0)))
                    for s in row.pop("sessions")
                ]
                groups.append(Group(**row, sessions=sessions))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{n}: not a trace line ({exc}); see bench/routing_trace.py"
                ) from None
    return groups, caps


def scaled(groups: list[Group], times: int, lengths: float = 1.0) -> list[Group]:
    """`times` copies of every group under new names (the env prefixes stay shared), token counts
    multiplied by `lengths`: a small recorded run as a bigger cluster's traffic."""
    out: list[Group] = []

    def n(x: int) -> int:
        return max(0, round(x * lengths))

    for k in range(times):
        for g in groups:
            sessions = [
                Session(
                    f"{s.session}~{k}",
                    [Turn(n(t.new), max(1, n(t.out)), t.gap_s) for t in s.turns],
                    s.start_turn,
                )
                for s in g.sessions
            ]
            out.append(
                Group(f"{g.group}~{k}", g.env, g.release_s, n(g.env_prefix), n(g.group_prefix), sessions)
            )
    out.sort(key=lambda g: (g.release_s, g.env, g.group))
    return out


def convert_record(lines: Iterable[dict]) -> tuple[list[Group], dict[str, int]]:
    """A gateway routing record (one dict per engine call, docs/routing.md) as groups.

    Turn k's `new` is its prompt length minus turn k-1's prompt and output (a fork or a rewritten
    history counts as new tokens); the shared prefixes are the record's `shared_env` /
    `shared_group` lengths of each group's first call. A group is released when its first call
    was made; each env's cap is the most sessions of it seen in flight at once.
    """
    calls = sorted(lines, key=lambda c: c["t"])
    if not calls:
        raise ValueError("the routing record has no calls")
    t0 = calls[0]["t"]
    by_session: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        by_session[c["session"]].append(c)
    groups: dict[str, Group] = {}
    live: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for sid, cs in by_session.items():
        first = cs[0]
        gid = first.get("group") or sid
        env = first.get("env") or "unknown"
        g = groups.get(gid)
        if g is None:
            env_prefix = int(first.get("shared_env") or 0)
            group_prefix = max(0, int(first.get("shared_group") or 0) - env_prefix)
            g = groups[gid] = Group(gid, env, first["t"] - t0, env_prefix, group_prefix)
        turns: list[Turn] = []
        prev_end, prev_len = first["t"], 0
        for k, c in enumerate(cs):
            prompt = int(c["prompt_tokens"])
            new = prompt - (g.env_prefix + g.group_prefix) if k == 0 else prompt - prev_len
            turns.append(
                Turn(
                    max(0, new),
                    max(1, int(c["output_tokens"])),
                    0.0 if k == 0 else max(0.0, c["t"] - prev_end),
                )
            )
            prev_len = prompt + int(c["output_tokens"])
            prev_end = c["t"] + float(c.get("engine_s") or 0.0)
        g.sessions.append(Session(sid, turns))
        live[env] += [(first["t"], 1), (prev_end, -1)]
    caps = {}
    for env, events in live.items():
        cur = peak = 0
        for _, d in sorted(events):
            cur += d
            peak = max(peak, cur)
        caps[env] = max(1, peak)
    return sorted(groups.values(), key=lambda g: (g.release_s, g.group)), caps


def _lines(path: str | Path) -> Iterator[dict]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not JSON ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="a synthetic trace of our environments' traffic")
    gen.add_argument("--engines", type=int, default=16)
    gen.add_argument("--duration-s", type=float, default=300.0)
    gen.add_argument("--step-s", type=float, default=30.0)
    gen.add_argument("--math-groups-per-engine", type=float, default=2.0)
    gen.add_argument("--swe-per-engine", type=float, default=16.0)
    gen.add_argument("--harness-per-engine", type=float, default=12.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", required=True)
    conv = sub.add_parser("convert", help="a gateway routing record (--routing-trace) as a trace")
    conv.add_argument("record")
    conv.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        groups, caps = generate(
            args.engines,
            duration_s=args.duration_s,
            step_s=args.step_s,
            math_groups_per_engine=args.math_groups_per_engine,
            swe_per_engine=args.swe_per_engine,
            harness_per_engine=args.harness_per_engine,
            seed=args.seed,
        )
    else:
        groups, caps = convert_record(_lines(args.record))
    write(args.out, groups, caps)
    sessions = sum(len(g.sessions) for g in groups)
    print(f"{args.out}: {len(groups)} groups, {sessions} sessions, caps {caps}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
