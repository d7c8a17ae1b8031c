"""What a live session's token list costs a full garbage collection, and what releasing a finished
session costs, at a long history: in one process, CPU time, ratios from one run.

    .venv/bin/python -m bench.session_heap [--history 100000] [--turns 64] [--sessions 1,8,32] [--rounds 5]

A session here is a chain of real `Turn`s bridged onto one token list (`Turn.extended`, as the
gateway records a harness's turns): `--turns` turns whose last prompt holds about `--history` ids,
drawn below 151k (a real vocabulary's: above 256, so each id is an int object of its own).

* release: `finished.pack_turns` of one session (each turn's summary with `lists=False`) against the
  packing it replaced (each turn's whole summary, its prompt copied out of the token list, then the
  three lists set to None); median CPU ms of `--rounds` alternating rounds, and the ratio. The two
  JSON texts are checked equal.
* memory: what one live session holds (tracemalloc), its token list's slots and int objects.
* full collection: the heap frozen first (as `palaestra gateway serve` freezes its start-up heap),
  `gc.collect()`'s CPU ms with each count of such sessions alive, and per session: what a full
  collection walks of a session is its lists, the token list's slots above all.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc

from bench import common
from palaestra.gateway.engine_side.generation import FinishReason
from palaestra.gateway.sessions.finished import pack_turns
from palaestra.gateway.sessions.trajectory import Turn


def session(rng: random.Random, history: int, turns: int) -> list[Turn]:
    """`turns` turns bridged onto one token list; the last prompt has about `history` ids."""
    step = max(history // turns, 2)
    out: list[Turn] = []
    parent = None
    for k in range(turns):
        new = [rng.randrange(257, 151_000) for _ in range(step - 1)]
        prompt = new if parent is None else parent.extended(new)
        answer = [rng.randrange(257, 151_000)]
        t = Turn(
            turn_id=k, call_id=f"c{k}", choice=0, parent=parent, prompt_ids=prompt, output_ids=answer,
            output_logprobs=[-0.5], weight_version="0", weight_spans=[],
            finish_reason=FinishReason({"type": "stop"}), latency_s=0.0, cached_tokens=0, kind="chat",
        )  # fmt: skip
        if parent is not None:
            parent.children += 1
        out.append(t)
        parent = t
    return out


def old_pack(turns: list[Turn], leaves: list[Turn]) -> str:
    """The packing before `summary(lists=False)` (a single bridged chain: every turn on the leaf's list)."""
    packed = []
    for turn in turns:
        summary = turn.summary()
        for key in ("prompt_ids", "output_ids", "output_logprobs"):
            summary[key] = None
        packed.append((summary, 0, len(turn.output_ids)))
    return json.dumps({"turns": packed, "parse_errors": {}, "ignored_controls": {}}, separators=(",", ":"))


def cpu_ms(fn) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def release(rng: random.Random, args: argparse.Namespace) -> None:
    """The release part (module doc)."""
    turns = session(rng, args.history, args.turns)
    leaves = [turns[-1]]
    assert pack_turns(turns, leaves, {}, {}) == old_pack(turns, leaves), "the packed JSON differs"
    new, old = [], []
    for _ in range(args.rounds):
        old.append(cpu_ms(lambda: old_pack(turns, leaves)))
        new.append(cpu_ms(lambda: pack_turns(turns, leaves, {}, {})))
    o, n = statistics.median(old), statistics.median(new)
    print(
        f"release of a {args.turns}-turn session of {turns[-1].end} ids: pack_turns {n:.2f} ms, "
        f"the whole summaries {o:.2f} ms (new/old {n / o:.3f}x; CPU, median of {args.rounds})"
    )


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--history", type=int, default=100_000, help="ids in a session's last prompt")
    ap.add_argument("--turns", type=int, default=64, help="turns per session")
    ap.add_argument(
        "--sessions", default="1,8,32", help="live sessions for the full collection (comma-separated)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for name in ("history", "turns", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be 1 or more; got {getattr(args, name)}")
    try:
        counts = sorted(int(x) for x in args.sessions.split(","))
    except ValueError:
        counts = [0]
    if min(counts) < 1:
        ap.error(
            f"--sessions takes counts of 1 or more, comma-separated (e.g. 1,8,32); got {args.sessions!r}"
        )
    rng = random.Random(39)

    release(rng, args)

    tracemalloc.start()
    one = session(rng, args.history, args.turns)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    ints = sum(sys.getsizeof(i) for i in one[-1].tokens)
    print(
        f"a live session of {one[-1].end} ids holds {held / 2**20:.2f} MiB (tracemalloc): its token list "
        f"{sys.getsizeof(one[-1].tokens) / 2**20:.2f} MiB of slots and {ints / 2**20:.2f} MiB of int objects "
        f"(an array('i') of the ids: {len(one[-1].tokens) * 4 / 2**20:.2f} MiB)"
    )
    del one

    gc.collect()
    gc.freeze()
    alive: list[list[Turn]] = []
    for k in counts:
        while len(alive) < k:
            alive.append(session(rng, args.history, args.turns))
        gc.collect()
        ms = statistics.median(cpu_ms(gc.collect) for _ in range(args.rounds))
        print(
            f"full collection with {k} sessions of {args.history} ids alive: {ms:.2f} ms "
            f"({ms / k:.2f} ms a session; CPU, median of {args.rounds})"
        )
    gc.unfreeze()


if __name__ == "__main__":
    main()
