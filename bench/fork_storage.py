"""What a session that forks stores on the gateway's disk, with forks written whole vs sharing their
prefix with an earlier record (gateway/sessions/shared_prefix.py), one run, ratios.

    .venv/bin/python -m bench.fork_storage [--turns 64] [--fork-every 8] [--history 8192]

Two gateway cores (`GatewayService`, in this process) over one zero-work engine
(`python -m palaestra.testing.zero`, the same reply every turn, tokenized as the tokenizer does, so
that a fork's re-rendered history tokenizes as it was sampled, as a model's usual output does): one whose spool and journal write every fork
whole (`share_prefixes` off: the format before forks shared), one as the gateway runs. The same chat
session runs on each: `--turns` turns whose user messages grow the history to about `--history`
tokens, and every `--fork-every` turns the agent edits the model's last reply (an
`assistant_edited` fork: a new sample whose prompt is the whole history). Printed per side: the
samples, the token ids stored in the spool (the `tokens` lists) and its per-response entries (loss
mask, logprobs, versions), the spool's bytes, the journal's token ids (prompts, tails, outputs) and
bytes, the time of the reward call's append (fsync included), and the median time to read every sample back (`SampleSpool.read`, which expands the
references); the samples read back are checked equal field for
field.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from bench import common
from palaestra.gateway.routes import OPENAI_CHAT
from palaestra.gateway.service import GatewayService
from palaestra.gateway.sessions import shared_prefix

SIDES = ("whole", "shared")
REPLY = "I have read the step and carried it out; the result is in the file, and the next step can start now."


def user_message(i: int, words: int) -> str:
    return f"Step {i}. " + " ".join(f"item{i}x{j}" for j in range(words))


async def session(svc: GatewayService, args: argparse.Namespace, words: int) -> list[dict[str, Any]]:
    """The session, finished; the samples the spool reads back."""
    sid = svc.create_session("bench", "t", None, {}, session_id="bench-fork-storage").session_id
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Follow the steps."}]
    for i in range(args.turns):
        if i and i % args.fork_every == 0:  # the agent rewrites the model's last reply: a fork
            messages[-1] = {**messages[-1], "content": "(edited) " + messages[-1]["content"]}
        messages.append({"role": "user", "content": user_message(i, words)})
        answer = await svc.chat(sid, {"model": "tiny", "messages": messages, "max_tokens": 64}, OPENAI_CHAT)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    done = await svc.finish(sid, 1.0, {}, "completed")
    first = done["cursors"][0] - 1
    return [r["sample"] for r in svc.spool.read(first, len(done["cursors"]))]


def spool_counts(directory: Path) -> dict[str, int]:
    ids = entries = size = 0
    for segment in sorted(directory.glob("samples-*.jsonl")):
        size += segment.stat().st_size
        for line in segment.read_bytes().splitlines():
            record = json.loads(line)
            body = record["part"] if "ref" in record else record["sample"]
            ids += len(body["tokens"])
            entries += sum(len(body[k]) for k in shared_prefix.PER_RESPONSE if body.get(k) is not None)
    return {"spool_ids": ids, "spool_entries": entries, "spool_bytes": size}


def journal_counts(directory: Path) -> dict[str, int]:
    ids = size = 0
    for segment in sorted(directory.glob("journal-*.log")):
        data = segment.read_bytes()
        size += len(data)
        offset = 0
        while offset < len(data):
            length = int.from_bytes(data[offset : offset + 4], "little")
            record = orjson.loads(data[offset + 8 : offset + 8 + length])
            offset += 8 + length
            if record["k"] == "turn":
                t = record["t"]
                ids += len(t.get("prompt", ())) + len(t.get("tail", ())) + len(t["out"])
    return {"journal_ids": ids, "journal_bytes": size}


async def run(args: argparse.Namespace, engine_url: str, tok: Any, root: Path) -> None:
    reply_len = len(tok.encode(REPLY, add_special_tokens=False)) + 1
    per_turn = args.history / args.turns - reply_len - 10  # 10: a turn's markup

    def user_len(words: int) -> int:
        return len(tok.encode(user_message(args.turns // 2, words), add_special_tokens=False))

    words = 1
    while user_len(words + 1) <= per_turn:
        words += 1
    results: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for side in SIDES:
        share = side == "shared"
        svc = common.gateway_service(engine_url, tok, root / side, share_prefixes=share)
        spool = svc.spool
        append, append_s = spool.append, []

        def timed_append(
            batch: list[dict[str, Any]], append: Any = append, took: list = append_s
        ) -> list[int]:
            t0 = time.perf_counter()
            cursors = append(batch)
            took.append(time.perf_counter() - t0)
            return cursors

        spool.append = timed_append  # type: ignore[method-assign]
        samples[side] = await session(svc, args, words)
        reads = []
        for _ in range(args.reads):
            t0 = time.perf_counter()
            again = spool.read(0, 1000)
            reads.append(time.perf_counter() - t0)
        read_s = statistics.median(reads)
        await svc.turns.engine.close()
        svc.close()
        spool.close()
        results[side] = {
            **spool_counts(root / side),
            **journal_counts(root / side),
            "read_ms": read_s * 1e3,
            "append_ms": sum(append_s) * 1e3,
            "samples": len(again),
            "history": len(samples[side][-1]["tokens"]),
            "forks": sum(1 for s in samples[side] if s["fork_reason"]),
        }
    assert samples["whole"] == samples["shared"], "the samples read back differ between the two sides"
    whole, shared = results["whole"], results["shared"]
    print(
        f"one session: {args.turns} turns, a fork every {args.fork_every} ({whole['forks']} forks, "
        f"{whole['samples']} samples), {whole['history']} tokens of history at the end; "
        "samples read back equal field for field on both sides"
    )
    rows = [
        ("spool token ids", "spool_ids", "{:,}"),
        ("spool per-response entries", "spool_entries", "{:,}"),
        ("spool bytes", "spool_bytes", "{:,}"),
        ("journal token ids", "journal_ids", "{:,}"),
        ("journal bytes", "journal_bytes", "{:,}"),
        ("append the samples (ms)", "append_ms", "{:.2f}"),
        ("read every sample, median (ms)", "read_ms", "{:.2f}"),
    ]
    print(f"  {'':28} {'whole':>12} {'shared':>12} {'shared/whole':>13}")
    for label, key, fmt in rows:
        ratio = shared[key] / whole[key] if whole[key] else float("nan")
        print(f"  {label:28} {fmt.format(whole[key]):>12} {fmt.format(shared[key]):>12} {ratio:>13.3f}")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--turns", type=int, default=64, help="chat turns in the session")
    ap.add_argument("--fork-every", type=int, default=8, help="the agent edits a reply every this many turns")
    ap.add_argument("--history", type=int, default=8192, help="tokens of history the session ends near")
    ap.add_argument("--dir", default="runs", help="where the spool directories go")
    ap.add_argument(
        "--reads", type=int, default=9, help="times every sample is read back (the median is shown)"
    )
    args = ap.parse_args()

    common.run_on_zero_engine(
        REPLY, args.dir, "bench-fork-storage-", lambda url, tok, root: run(args, url, tok, root)
    )


if __name__ == "__main__":
    main()
