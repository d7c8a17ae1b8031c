"""A turn's request body read and parsed, along a session: whole (`guards.read_json` of every body,
the parse memo writing the history out to find what it repeats) against incremental (the session's
`ParseMemo.read_body`, gateway/sessions/body_memo.py), in one run, per dialect.

    .venv/bin/python -m bench.body_parse [--turns 64] [--history 100000] [--rounds 5] [--profile]

The sessions are the paired bench's (bench/gateway.py: `paired_body`, user turns padded so the last
turn's history has about `--history` tokens, the reply sent back as its SDK hands it over), written
as Python's `json.dumps` writes them (`", "` and `": "`, non-ASCII escaped). For each turn both ways
run on the same bytes, alternating, each `--rounds` times (the CPU time's median, `time.process_time`):
the body read, then the dialect's parse with the session's memo. `--profile` adds a cProfile of the
last turn each way (the functions that cost most).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from bench import common
from bench.gateway import paired_body
from palaestra.gateway import routes
from palaestra.gateway.guards import read_json
from palaestra.gateway.sessions.history import ParseMemo

DIALECTS = {
    "chat": routes.OPENAI_CHAT,
    "responses": routes.OPENAI_RESPONSES,
    "messages": routes.ANTHROPIC_MESSAGES,
}


def reply(dialect: str, turn: int) -> list[dict[str, Any]]:
    text = f"Reply {turn}: done. Anything else? é"
    if dialect == "responses":
        return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return [{"role": "assistant", "content": text}]


def bodies(dialect: str, turns: int, history_tokens: int) -> list[bytes]:
    filler = " word" * (history_tokens // turns)  # ~1 token a word with the tiny tokenizer
    history: list[dict[str, Any]] = []
    out = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}: please continue.{filler}"})
        out.append(json.dumps(paired_body(dialect, "You are helpful.", history, 64)).encode())
        history += reply(dialect, turn)
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--turns", type=int, default=64, help="turns per session")
    ap.add_argument("--history", type=int, default=100000, help="tokens of the last turn's history")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each way per turn (the median)")
    ap.add_argument("--profile", action="store_true", help="a cProfile of the last turn each way")
    args = ap.parse_args()
    rejected = Counter("rejected", "", ["reason"], registry=CollectorRegistry())
    key = {"chat": "messages", "responses": "input", "messages": "messages"}
    print(f"body read + dialect parse per turn, CPU ms (median of {args.rounds}), turns 1-8 -> last 8:")
    for name, dialect in DIALECTS.items():
        raws = bodies(name, args.turns, args.history)
        whole_memo, incremental_memo = ParseMemo(), ParseMemo()

        def whole(raw: bytes, dialect: Any = dialect, memo: ParseMemo = whole_memo) -> None:
            dialect.parse(read_json(raw, rejected), memo)

        def incremental(
            raw: bytes, dialect: Any = dialect, memo: ParseMemo = incremental_memo, name: str = name
        ) -> None:
            dialect.parse(memo.read_body(raw, name, key[name], rejected), memo)

        costs: dict[str, list[float]] = {"whole": [], "incremental": []}
        for raw in raws:
            per: dict[str, list[float]] = {"whole": [], "incremental": []}
            for _ in range(args.rounds):  # the memos see each body `rounds` times: the same reuse
                for label, fn in (("whole", whole), ("incremental", incremental)):
                    t0 = time.process_time()
                    fn(raw)
                    per[label].append(time.process_time() - t0)
            for label in per:
                costs[label].append(statistics.median(per[label]) * 1e3)
        w, i = costs["whole"], costs["incremental"]
        first, last = slice(0, 8), slice(-8, None)
        print(
            f"  {name:9s} {len(raws[-1]) / 1e3:.0f} KB last body: whole {statistics.mean(w[first]):.3f} -> "
            f"{statistics.mean(w[last]):.3f} ms ({statistics.mean(w[last]) / statistics.mean(w[first]):.2f}x), "
            f"incremental {statistics.mean(i[first]):.3f} -> {statistics.mean(i[last]):.3f} ms "
            f"({statistics.mean(i[last]) / statistics.mean(i[first]):.2f}x); last 8: incremental/whole "
            f"{statistics.mean(i[last]) / statistics.mean(w[last]):.2f}x"
        )
        if args.profile:
            for label, fn in (("whole", whole), ("incremental", incremental)):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    fn(raws[-1])
                prof.disable()
                rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:5]  # type: ignore[attr-defined]
                print(
                    f"    profile of the last turn, {label} (own CPU per call): "
                    + "; ".join(f"{fn} {tt / 20 * 1e3:.3f} ms" for (_, _, fn), (_, _, tt, _, _) in rows)
                )


if __name__ == "__main__":
    main()
