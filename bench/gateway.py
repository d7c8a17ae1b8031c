"""Gateway benchmark, one run, ratios: per-call overhead, per-turn CPU growth, turns/s under concurrency.

    .venv/bin/python -m bench.gateway [--calls 300] [--turns 64] [--sessions 24] [--parts overhead,growth,paired,load]
    .venv/bin/python -m bench.gateway --parts paired [--paired-history 8000,32000,100000] [--paired-answers stop,cut] [--paired-detail]
    .venv/bin/python -m bench.gateway --parts overhead --baseline-python ../main/.venv/bin/python

Everything runs against a zero-work engine (palaestra/testing/zero.py), so only the layers in front of it
are measured:
* per-call overhead of each dialect (chat, Responses, Messages: parse, render, bridge, record,
  answer) and of the real sglang-router, each minus a direct /generate to the same engine; the
  paths are interleaved, in two schedules: "apart", each gateway call after the same three calls as
  the router's (each server woken from idle), and "in runs", 10 calls to one path in a row after one
  left out (a busy server; --run-skip 6 leaves out the ~5 calls a server takes to warm up) (goal:
  gateway <= 1.2x the router), and the floor under them: a minimal Python pass-through proxy
  (bench/_passthrough.py, a test double) on the gateway's server and engine client; with
  --baseline-python, another checkout's gateway (the code that interpreter imports) served beside
  this one and interleaved with it, call by call: a before/after in one run;
* gateway CPU per turn at turns 61-64 vs turns 1-4 of sessions in each dialect, read from /proc,
  the two measured in alternating rounds (goal <= 1.2x: an append renders only what is new);
* the gateway's own cost per turn along a session, paired: each turn's latency minus that of a
  direct /generate of the very body the gateway sent the engine for it (the zero engine keeps it),
  sent right after it, in buckets of 8 turns; with --paired-detail also what carrying the turn's
  request body costs alone (posted to the zero engine's `/sink`, which reads and drops it, less a
  2-byte body: the client's share of a turn that the direct call does not carry, 0.4-0.5 MB at a
  100k-token history) and the gateway's CPU for the turn (schedstat, every thread)
  (goal: the last bucket <= 1.2x the first; CPU time alone misses what grows in wall time), per
  dialect, for answers that end on the end-of-turn token and answers cut at the length limit
  (the client sends either back as its SDK hands it over), at several history sizes (user turns
  padded so the last turn's history has that many tokens), with what one session of each left:
  forks, samples, the tokens they store, the tokens an engine's prefix cache would prefill per turn;
* turns/s through the gateway at 1, 16 and 128 concurrent sessions;
* with --parts idle (not in the default): what a call of the gateway and of the floor costs after
  the server sat idle (in latency and in the server's CPU), and by position in a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench import _passthrough, common
from palaestra.engine.router import RouterProcess
from palaestra.gateway.cli import gateway_process
from palaestra.testing import zero as zero_engine

KEY = {"Authorization": "Bearer bench"}
ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, from schedstat (nanoseconds; /proc/PID/stat counts 10 ms
    ticks, too coarse for a per-turn cost of about a millisecond)."""
    return sum(cpu for cpu, _ in common.thread_stats(pid).values()) / 1e9


RUN = 10
"""Calls to one path in a row in the overhead part's second schedule (after `--run-skip` left out)."""

PAIRED_PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}


def paired_body(dialect: str, system: str, history: list, max_tokens: int) -> dict:
    """One turn's request in `dialect`: the system prompt, the whole history, the answer's budget."""
    if dialect == "chat":
        msgs = [{"role": "system", "content": system}, *history]
        return {"model": "tiny", "messages": msgs, "max_tokens": max_tokens}
    if dialect == "responses":
        return {"model": "tiny", "instructions": system, "input": history, "max_output_tokens": max_tokens}
    return {"model": "tiny", "system": system, "messages": history, "max_tokens": max_tokens}


def paired_reply(dialect: str, answer: dict) -> tuple[int, list, str]:
    """(prompt tokens, the history items the client sends back, the finish) of an answer in `dialect`:
    each sends the answer back as its SDK hands it over."""
    if dialect == "chat":
        choice = answer["choices"][0]
        reply = {"role": "assistant", "content": choice["message"]["content"]}
        return answer["usage"]["prompt_tokens"], [reply], choice["finish_reason"]
    if dialect == "responses":
        return answer["usage"]["input_tokens"], answer["output"], answer["status"]
    reply = {"role": "assistant", "content": answer["content"]}
    return answer["usage"]["input_tokens"], [reply], answer["stop_reason"]


def session_record(c: httpx.Client, gw_url: str, session_id: str) -> dict:
    """What one finished session left (from its trajectory): forks, samples (its leaves), the tokens
    those samples store, and the tokens an engine with a prefix cache holding the session's previous
    call (prompt + output) would prefill per turn."""
    traj = c.get(f"{gw_url}/sessions/{session_id}", headers=KEY).json()
    turns = traj["turns"]
    parents = {t["parent"] for t in turns}
    leaves = [t for t in turns if t["turn_id"] not in parents]
    prefill = []
    for prev, cur in zip(turns, turns[1:], strict=False):
        held, prompt = prev["prompt_ids"] + prev["output_ids"], cur["prompt_ids"]
        same = 0
        if prompt[: len(held)] == held:
            same = len(held)
        else:
            for a, b in zip(held, prompt, strict=False):
                if a != b:
                    break
                same += 1
        prefill.append(len(prompt) - same)
    c.post(f"{gw_url}/sessions/{session_id}/reward", json={"reward": 0.0}, headers=KEY).raise_for_status()
    return {
        "forks": len(traj["forks"]),
        "samples": len(leaves),
        "stored": sum(t["prompt_len"] + len(t["output_ids"]) for t in leaves),
        "prefill": statistics.mean(prefill) if prefill else 0.0,
        "history": turns[-1]["prompt_len"],
    }


def paired_cost(
    c: httpx.Client,
    gw_url: str,
    gw_pid: int,
    engine_url: str,
    system: str,
    dialect: str,
    max_tokens: int,
    filler: str,
    turns: int,
    slots: int,
    cycles: int,
    detail: bool = False,
) -> dict:
    """The gateway's own cost per turn along a session in `dialect`: each turn's latency minus that of a
    direct /generate of the very body the gateway sent the engine for it (the zero engine keeps it:
    `--keep-bodies`), sent right after it. `slots` sessions run side by side, staggered by turns /
    slots, each replaced by a fresh one when it reaches `turns`: every round has a session in every
    bucket of 8 turns, so the machine's noise hits them alike. Each user turn carries `filler` (the
    history's size); answers are the engine's reply cut at `max_tokens`. Returns the medians per bucket and the first finished session's
    record (`session_record`)."""
    if turns % 8 or turns < 16:
        raise SystemExit("--turns must be a multiple of 8 and at least 16 for the paired test")
    headers = {**KEY, "Content-Type": "application/json"}
    path = PAIRED_PATHS[dialect]
    record: dict = {}

    def new_slot() -> dict:
        r = c.post(f"{gw_url}/sessions", json={"env": "bench"}, headers=KEY)
        return {"url": r.json()["base_url"], "id": r.json()["session_id"], "history": [], "turn": 0}

    def turn(slot: dict) -> tuple[int, float]:
        """One gateway turn, then the direct call of its size: (turn index, latency difference)."""
        text = f"Turn {slot['turn']}: please continue the task with more detail.{filler}"
        slot["history"].append({"role": "user", "content": text})
        body = orjson.dumps(paired_body(dialect, system, slot["history"], max_tokens))
        cpu0 = cpu_seconds(gw_pid) if detail else 0.0
        t0 = time.perf_counter()
        r = c.post(f"{slot['url']}{path}", content=body, headers=headers)
        gw_s = time.perf_counter() - t0
        cpu_s = cpu_seconds(gw_pid) - cpu0 if detail else 0.0
        r.raise_for_status()
        n, items, _ = paired_reply(dialect, r.json())
        kept = c.get(f"{engine_url}/last_body", params={"key": slot["id"]})  # what the gateway sent
        kept.raise_for_status()
        direct_body = kept.content
        t0 = time.perf_counter()
        d = c.post(
            f"{engine_url}/generate", content=direct_body, headers={"Content-Type": "application/json"}
        )
        direct_s = time.perf_counter() - t0
        d.raise_for_status()
        if d.json()["meta_info"]["prompt_tokens"] != n:
            raise SystemExit("the direct call did not carry the turn's number of input ids")
        carry_s = 0.0
        if detail:  # the client's body carried alone: to a server that reads and drops it, less a small one
            t0 = time.perf_counter()
            c.post(f"{engine_url}/sink", content=body, headers=headers).raise_for_status()
            whole_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            c.post(f"{engine_url}/sink", content=b"{}", headers=headers).raise_for_status()
            carry_s = whole_s - (time.perf_counter() - t0)
        slot["history"] += items
        index, slot["turn"] = slot["turn"], slot["turn"] + 1
        return index, gw_s - direct_s, carry_s, cpu_s

    step = turns // slots
    live = [new_slot() for _ in range(slots)]
    for k, slot in enumerate(live):  # staggered: slot k starts at turn k * step (unmeasured)
        for _ in range(k * step):
            turn(slot)
    diffs: dict[int, list[float]] = {b: [] for b in range(turns // 8)}
    carries: dict[int, list[float]] = {b: [] for b in range(turns // 8)}
    cpus: dict[int, list[float]] = {b: [] for b in range(turns // 8)}
    for _ in range(cycles * turns):
        for k, slot in enumerate(live):
            index, diff, carry, cpu = turn(slot)
            diffs[index // 8].append(diff)
            carries[index // 8].append(carry)
            cpus[index // 8].append(cpu)
            if slot["turn"] == turns:
                if not record:
                    record = session_record(c, gw_url, slot["id"])
                live[k] = new_slot()
    return {
        "buckets": {b: statistics.median(d) for b, d in diffs.items()},
        "carry": {b: statistics.median(d) for b, d in carries.items()},
        "cpu": {b: statistics.median(d) for b, d in cpus.items()},
        **record,
    }


def paired_table(
    c: httpx.Client,
    gw_url: str,
    gw_pid: int,
    engine_url: str,
    reply: list[int],
    system: str,
    dialects: list[str],
    answers: list[str],
    histories: list[int],
    args,
    tok,
) -> None:
    """`paired_cost` per dialect, kind of answer (`stop`: ends on the end-of-turn; `cut`: stopped at
    the length limit) and history size at the last turn, printed as one table."""
    budgets = {"stop": len(reply) + 1, "cut": max(1, len(reply) // 2)}
    word = " lorem ipsum dolor sit amet"
    per_word = len(tok.encode(word * 100, add_special_tokens=False)) / 100
    for dialect in dialects:  # warm-up, unmeasured: the first turns of a fresh gateway cost more
        for kind in answers:
            paired_cost(c, gw_url, gw_pid, engine_url, system, dialect, budgets[kind], "", 16, 2, 1)
    rows = []
    for size in histories:
        # each turn adds about 30 tokens of template, question and answer beside its filler
        words = max(0, round((size / args.turns - 30) / per_word))
        for dialect in dialects:
            for kind in answers:
                got = paired_cost(
                    c,
                    gw_url,
                    gw_pid,
                    engine_url,
                    system,
                    dialect,
                    budgets[kind],
                    word * words,
                    args.turns,
                    args.paired_sessions,
                    args.paired_cycles,
                    args.paired_detail,
                )
                rows.append((dialect, kind, got))
                b, carry = got["buckets"], got["carry"]
                print(
                    f"  {dialect:9} {kind:4} history {got['history']:>6} tokens: "
                    + " ".join(f"{m * 1e3:.2f}" for m in b.values())
                    + f" ms -> last/first {b[len(b) - 1] / b[0]:.2f}x; "
                    + (
                        "the client's body alone "
                        + " ".join(f"{m * 1e3:.2f}" for m in carry.values())
                        + " ms; gateway CPU "
                        + " ".join(f"{m * 1e3:.2f}" for m in got["cpu"].values())
                        + " ms; "
                        if args.paired_detail
                        else ""
                    )
                    + f"forks {got['forks']}, samples "
                    f"{got['samples']}, stored {got['stored']} tokens, prefill {got['prefill']:.0f} tokens/turn",
                    flush=True,
                )
    n = args.turns // 8
    print(
        f"\ngateway's own cost per turn, {args.turns}-turn sessions (turn minus a direct /generate of as many "
        "input ids, paired, medians, ms):"
    )
    extra = (
        " the client's body alone, first -> last | last/first, less the body | gateway CPU, first -> last |"
        if args.paired_detail
        else ""
    )
    print(
        "| dialect | answers | history at the last turn (tokens) | turns 1-8 | "
        + f"turns {8 * n - 7}-{8 * n} | last/first |{extra} forks | samples | stored tokens | "
        "prefill tokens/turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.paired_detail else ""))
    for dialect, kind, got in rows:
        b, carry, cpu = got["buckets"], got["carry"], got["cpu"]
        cells = ""
        if args.paired_detail:
            less = (b[n - 1] - carry[n - 1]) / (b[0] - carry[0])
            cells = (
                f" {carry[0] * 1e3:.2f} -> {carry[n - 1] * 1e3:.2f} | {less:.2f}x | "
                f"{cpu[0] * 1e3:.2f} -> {cpu[n - 1] * 1e3:.2f} ({cpu[n - 1] / cpu[0]:.2f}x) |"
            )
        print(
            f"| {dialect} | {kind} | {got['history']} | {b[0] * 1e3:.2f} | {b[n - 1] * 1e3:.2f} | "
            f"{b[n - 1] / b[0]:.2f}x |{cells} "
            f"{got['forks']} | {got['samples']} | {got['stored']} | {got['prefill']:.0f} |"
        )


IDLE_GAPS = {
    "in a run": None,
    "after 2 direct calls": "direct",
    "after 2 ms asleep": 0.002,
    "after 20 ms asleep": 0.02,
}
"""What comes before each measured call in the idle part: nothing (the call before was to the same
server), other servers' calls (what `apart` puts there), or the client asleep."""


def idle_part(c: httpx.Client, *, paths: dict, targets: dict, calls: int) -> None:
    """What a call costs after its server sat idle, and whether it is the server's own work.

    For each of `targets` (name -> (pid, call): the gateway's chat, the same gateway with its
    journal's fsync thread off, the floor): each call's latency and the server's CPU
    per call (schedstat, all its threads) after each of `IDLE_GAPS`, in rounds of `calls // 4` so
    the machine's drift hits every gap alike; then, for each dialect, the cost of each position in
    a run of 10 after the other servers' calls. A server that does the same work per call but
    reads more CPU after a gap pays for what the gap did to the machine (its caches, the CPU's
    state), not for a thread or timer of its own; the positions show how many calls it takes to
    get back to its steady cost."""
    per_round = max(1, calls // 4)
    results: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for _ in range(3):
        for who, (pid, call) in targets.items():
            for gap_name, gap in IDLE_GAPS.items():
                lat, cpu = results.setdefault((who, gap_name), ([], []))
                before = cpu_seconds(pid)
                for _ in range(per_round):
                    if gap == "direct":
                        paths["direct"]()
                        paths["direct"]()
                    elif gap is not None:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    call()
                    lat.append(time.perf_counter() - t0)
                cpu.append((cpu_seconds(pid) - before) / per_round)
    for who in targets:
        steady = statistics.median(results[(who, "in a run")][1])
        print(
            f"idle: {who}, latency median and server CPU per call (median of 3 rounds; x in a run): "
            + "; ".join(
                f"{gap_name} {statistics.median(lat) * 1e3:.2f} ms, CPU {statistics.median(cpu) * 1e3:.2f} ms "
                f"({statistics.median(cpu) / steady:.2f}x)"
                for (w, gap_name), (lat, cpu) in results.items()
                if w == who
            )
        )
    dialects = [d for d in ("chat", "responses", "messages") if d in paths]
    for first in dialects:
        order = [first, *(d for d in dialects if d != first)]
        by_pos: dict[tuple[str, int], list[float]] = {}
        direct: list[float] = []
        for _ in range(max(1, calls // RUN // 2)):
            for name in ("direct", "python hop", *order):
                for i in range(RUN):
                    t0 = time.perf_counter()
                    paths[name]()
                    took = time.perf_counter() - t0
                    if name == "direct":
                        direct.append(took)
                    else:
                        by_pos.setdefault((name, i), []).append(took)
        base = statistics.median(direct)
        print(
            f"idle: runs of {RUN} after the other servers', {' then '.join(order)}: ms over a direct "
            "call by position in the run: "
            + "; ".join(
                f"{d} "
                + " ".join(f"{(statistics.median(by_pos[(d, i)]) - base) * 1e3:.2f}" for i in range(RUN))
                for d in order
            )
        )


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--calls",
        type=int,
        default=300,
        help="calls per gateway path in the overhead test (each after a direct, a router and a floor call)",
    )
    ap.add_argument("--turns", type=int, default=64, help="turns per session in the CPU-growth test")
    ap.add_argument("--sessions", type=int, default=24, help="sessions in the CPU-growth test")
    ap.add_argument(
        "--dialects",
        default="chat,responses,messages",
        help="dialects to measure (comma-separated; 'chat' alone measures a gateway without the others)",
    )
    ap.add_argument(
        "--parts",
        default="overhead,growth,paired,load",
        help="what to measure (comma-separated): overhead, growth (CPU per turn), paired (cost per turn "
        "minus a direct call of the same size), load, idle (what a call costs after the server sat idle; "
        "not in the default)",
    )
    ap.add_argument(
        "--baseline-python",
        default=None,
        help="overhead part: the interpreter of another checkout (e.g. ../main/.venv/bin/python) whose "
        "gateway is measured beside this one, interleaved call by call",
    )
    ap.add_argument(
        "--run-skip",
        type=int,
        default=1,
        help="overhead part, in runs: calls left out at the start of each run (a server woken from idle "
        "takes ~5 calls to reach its steady cost, so with 1 the first dialect after the other servers "
        "reads dearer than the rest; 6 measures every dialect warm)",
    )
    ap.add_argument("--paired-sessions", type=int, default=4, help="sessions side by side in the paired test")
    ap.add_argument("--paired-cycles", type=int, default=1, help="turns of each bucket per session slot")
    ap.add_argument(
        "--paired-detail",
        action="store_true",
        help="also time each turn's request body carried alone and read the gateway's CPU per turn "
        "(two more calls and /proc reads between turns: the gateway idles longer, which raises "
        "every bucket's cost; off, the table is comparable with earlier runs)",
    )
    ap.add_argument(
        "--paired-history",
        default="8000,32000,100000",
        help="history sizes at the last turn in the paired test (tokens, comma-separated; user turns "
        "are padded to reach them)",
    )
    ap.add_argument(
        "--paired-answers",
        default="stop,cut",
        help="answers in the paired test: stop (end on the end-of-turn), cut (stopped at the length limit)",
    )
    args = ap.parse_args()
    if args.run_skip < 0:
        ap.error(f"--run-skip must be 0 or more; got {args.run_skip}")
    dialects = args.dialects.split(",")
    parts = set(args.parts.split(","))
    unknown = parts - {"overhead", "growth", "paired", "load", "idle"}
    if unknown:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (overhead, growth, paired, load, idle)")

    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    reply = tok.encode("Sure, here it is.", add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    zero = zero_engine.process("--reply-ids", *map(str, reply), "--context-length", "262144", "--keep-bodies")
    # the gateways' spools and journals, removed after the run (each run left ~11 MB in runs/)
    with (
        tempfile.TemporaryDirectory(prefix="bench-gateway-spool-") as spool_dir,
        zero,
        RouterProcess([zero.url]) as router,
        _passthrough.process(zero.url) as hop,
        gateway_process("tiny", zero.url, str(Path(spool_dir) / "gateway"), env=ENV) as gw,
        httpx.Client(timeout=60, trust_env=False) as c,
        contextlib.ExitStack() as extra,
    ):
        spool = Path(spool_dir)
        gen_body = {"input_ids": reply * 8, "sampling_params": {"max_new_tokens": 8}}

        def new_session() -> str:
            return c.post(f"{gw.url}/sessions", json={"env": "bench"}, headers=KEY).json()["base_url"]

        base = new_session()
        chat_body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": 8,
        }
        responses_body = {"model": "tiny", "input": "Say something short.", "max_output_tokens": 8}
        messages_body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": 8,
        }
        all_paths = {
            "direct": lambda: c.post(f"{zero.url}/generate", json=gen_body),
            "router": lambda: c.post(
                f"{router.url}/generate", json=gen_body, headers={"X-SMG-Routing-Key": "k"}
            ),
            # the floor: a Python hop alone (bench/_passthrough.py, a test double), the gateway's client
            "python hop": lambda: c.post(
                f"{hop.url}/generate", json=gen_body, headers={"X-SMG-Routing-Key": "k"}
            ),
            "chat": lambda: c.post(f"{base}/chat/completions", json=chat_body, headers=KEY),
            "responses": lambda: c.post(f"{base}/responses", json=responses_body, headers=KEY),
            "messages": lambda: c.post(f"{base}/messages", json=messages_body, headers=KEY),
        }
        baseline = []
        if args.baseline_python and "overhead" in parts:
            other = gateway_process(
                "tiny", zero.url, str(spool / f"baseline-{time.time()}"), env={**ENV, "PYTHONPATH": ""}
            )
            # its own code, wherever that interpreter imports it from (-P: not this tree's from the cwd)
            other.argv[0:1] = [args.baseline_python, "-P"]
            other_gw = extra.enter_context(other)
            other_base = c.post(f"{other_gw.url}/sessions", json={"env": "bench"}, headers=KEY).json()[
                "base_url"
            ]
            other_paths = {
                "chat": lambda: c.post(f"{other_base}/chat/completions", json=chat_body, headers=KEY),
                "responses": lambda: c.post(f"{other_base}/responses", json=responses_body, headers=KEY),
                "messages": lambda: c.post(f"{other_base}/messages", json=messages_body, headers=KEY),
            }
            baseline = [d for d in dialects if d in other_paths]
            all_paths.update({f"baseline {d}": other_paths[d] for d in baseline})
        if "overhead" in parts:
            paths = {
                k: v
                for k, v in all_paths.items()
                if k in ("direct", "router", "python hop", *dialects, *(f"baseline {d}" for d in baseline))
            }
            for _ in range(20):  # warm-up of every path
                for call in paths.values():
                    call().raise_for_status()
            servers = [name for name in paths if name in ("direct", "router", "python hop")]
            gateways = [name for name in paths if name not in servers]

            def timed(name: str, into: dict[str, list[float]]) -> None:
                t0 = time.perf_counter()
                paths[name]()
                into.setdefault(name, []).append(time.perf_counter() - t0)

            # Two schedules, both interleaved so that the machine's noise hits every path alike.
            # Apart: each gateway call after a direct, a router and a floor call, as the router's
            # follows a direct one: every server has sat idle through the others' calls and pays
            # for waking up (what a lightly used gateway pays). In runs: `RUN` calls to one path
            # in a row, the first `--run-skip` of each left out (a busy server). A server woken from
            # idle reaches its steady cost only after ~5 calls (the gateway's first calls of a run
            # read 1.1, 0.9, 0.8 ms, then 0.6), so with one left out the first dialect after the
            # other servers (chat) read 0.1 ms dearer than the two that follow a gateway's run.
            # The old schedule (the three dialects in a row after the servers) mixed the two: the
            # dialect that went first paid the wake-up and read 0.1-0.2 ms dearer than the others.
            apart: dict[str, list[float]] = {}
            for _ in range(args.calls):
                for gateway_path in gateways:
                    for name in (*servers, gateway_path):
                        timed(name, apart)
            in_runs: dict[str, list[float]] = {}
            for _ in range(max(1, args.calls // RUN)):
                for name in paths:
                    for _ in range(args.run_skip):
                        paths[name]()  # the wake-up, left out
                    for _ in range(RUN):
                        timed(name, in_runs)
            runs_label = "in runs" if args.run_skip == 1 else f"in runs ({args.run_skip} left out)"
            for label, times in (("apart", apart), (runs_label, in_runs)):
                med = {name: statistics.median(t) for name, t in times.items()}
                direct, r_over = med["direct"], med["router"] - med["direct"]
                print(
                    f"{label}: per-call overhead over a direct /generate ({direct * 1e3:.2f} ms): router "
                    f"{r_over * 1e3:.2f} ms; "
                    + ", ".join(
                        f"{name} {(med[name] - direct) * 1e3:.2f} ms -> {(med[name] - direct) / r_over:.2f}x router"
                        for name in dialects
                    )
                )
                if baseline:
                    print(
                        f"{label}: beside it, the gateway of {args.baseline_python}: "
                        + ", ".join(
                            f"{d} {(med[f'baseline {d}'] - direct) * 1e3:.2f} ms -> "
                            f"{(med[f'baseline {d}'] - direct) / r_over:.2f}x router; this one / it "
                            f"{(med[d] - direct) / (med[f'baseline {d}'] - direct):.2f}x"
                            for d in baseline
                        )
                    )
                hop_over = med["python hop"] - direct
                print(
                    f"{label}: the floor, a minimal Python pass-through proxy (bench/_passthrough.py: uvicorn, "
                    f"the gateway's engine client): {hop_over * 1e3:.2f} ms -> {hop_over / r_over:.2f}x router"
                )

        if "idle" in parts:
            # the same gateway with its journal's fsync thread off (`--journal-fsync off`: no thread)
            quiet = extra.enter_context(
                gateway_process(
                    "tiny",
                    zero.url,
                    str(spool / f"journal-off-{time.time()}"),
                    env=ENV,
                    extra_args=["--journal-fsync", "off"],
                )
            )
            quiet_base = c.post(f"{quiet.url}/sessions", json={"env": "bench"}, headers=KEY).json()[
                "base_url"
            ]
            targets = {
                "gateway chat": (gw.pid, all_paths["chat"]),
                "gateway chat, journal fsync off": (
                    quiet.pid,
                    lambda: c.post(f"{quiet_base}/chat/completions", json=chat_body, headers=KEY),
                ),
                "floor": (hop.pid, all_paths["python hop"]),
            }
            idle_part(c, paths=all_paths, targets=targets, calls=args.calls)

        # CPU per turn at turn 1 vs turn N (lockstep rounds over many sessions, CPU read from /proc)
        system = "You are a helpful agent. " * 20

        def chat_turn(url: str, history: list, text: str) -> None:
            history.append({"role": "user", "content": text})
            body = {"model": "tiny", "messages": [{"role": "system", "content": system}, *history]}
            r = c.post(f"{url}/chat/completions", json=body, headers=KEY)
            r.raise_for_status()
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

        def responses_turn(url: str, history: list, text: str) -> None:
            history.append({"role": "user", "content": text})
            body = {"model": "tiny", "instructions": system, "input": history}
            r = c.post(f"{url}/responses", json=body, headers=KEY)
            r.raise_for_status()
            history += r.json()["output"]

        def messages_turn(url: str, history: list, text: str) -> None:
            history.append({"role": "user", "content": text})
            body = {"model": "tiny", "system": system, "messages": history, "max_tokens": 64}
            r = c.post(f"{url}/messages", json=body, headers=KEY)
            r.raise_for_status()
            history.append({"role": "assistant", "content": r.json()["content"]})

        growth = {}
        turn_fns = {"chat": chat_turn, "responses": responses_turn, "messages": messages_turn}
        if "growth" in parts:

            def cpu_round(turn_fn, sessions: list[tuple[str, list]], turn: int) -> float:
                before = cpu_seconds(gw.pid)
                for url, history in sessions:
                    turn_fn(url, history, f"Turn {turn}: please continue the task with more detail.")
                return (cpu_seconds(gw.pid) - before) / len(sessions)

            for dialect in dialects:
                turn_fn = turn_fns[dialect]
                long: list[tuple[str, list]] = [(new_session(), []) for _ in range(args.sessions)]
                for turn in range(args.turns - 4):  # brought to the last rounds' depth, unmeasured
                    cpu_round(turn_fn, long, turn)
                # turns 1-4 of fresh sessions interleaved round by round with turns N-3..N of the long
                # ones, so a change in the machine's load hits both ends alike
                fresh: list[tuple[str, list]] = [(new_session(), []) for _ in range(args.sessions)]
                first, last = [], []
                for k in range(4):
                    first.append(cpu_round(turn_fn, fresh, k))
                    last.append(cpu_round(turn_fn, long, args.turns - 4 + k))
                growth[dialect] = (statistics.mean(first), statistics.mean(last))
            print(
                f"gateway CPU per turn, turn 1 -> turn {args.turns} ({2 * args.turns} messages of history): "
                + ", ".join(
                    f"{d} {a * 1e3:.2f} -> {b * 1e3:.2f} ms = {b / a:.2f}x" for d, (a, b) in growth.items()
                )
            )

        if "paired" in parts:
            paired_table(
                c,
                gw.url,
                gw.pid,
                zero.url,
                reply,
                system,
                dialects,
                args.paired_answers.split(","),
                [int(x) for x in args.paired_history.split(",")],
                args,
                tok,
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

        if "load" not in parts:
            return
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
