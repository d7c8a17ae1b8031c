"""What a finished session keeps of its turns: their summaries, with the token lists left in the spool.

Once the reward call has made a session's samples durable, every id and logprob its turns hold is
in those samples: a turn's prompt is a prefix of the tokens of a sample whose path runs through it
(a bridged turn's prompt is its parent's prompt + output + the bridge), its output follows the
prompt, and its logprobs sit at the same positions of the sample's `rollout_logprobs`. So the
session keeps `pack_turns`'s compact JSON (each turn's summary without `prompt_ids`, `output_ids`
and `output_logprobs`, plus which sample holds them and how many output ids it has), and
GET /sessions/{id} puts the lists back from the spooled samples (`unpack_turns`). A finished
session then costs a few KiB (2-3 for 3 turns) instead of tens (tests/gateway/test_load.py measures it),
and the gateway's memory returns to its baseline when sessions finish. Where the samples are no
longer in the spool, the lists are answered as null.
"""

from __future__ import annotations

import json
from typing import Any

from palaestra.gateway.sessions.trajectory import Turn


def pack_turns(
    turns: list[Turn], leaves: list[Turn], parse_errors: dict[str, int], ignored: dict[str, int]
) -> str | None:
    """The turns' summaries without token lists (sample `i` is `leaves[i]`'s), or None when a turn's
    ids are not where its sample puts them (then the session must keep its turns whole)."""
    holder: dict[int, int] = {}  # turn id -> the first sample whose path runs through it
    for i, leaf in enumerate(leaves):
        t: Turn | None = leaf
        while t is not None and t.turn_id not in holder:
            holder[t.turn_id] = i
            t = t.parent
    packed = []
    for turn in turns:
        i = holder.get(turn.turn_id)
        if i is None:
            return None
        leaf, m = leaves[i], len(turn.output_ids)
        # the sample's tokens are the leaf's prompt + output; an inner turn lies in the leaf's prompt
        # (where the two share their token list it does by construction)
        if (
            turn is not leaf
            and turn.tokens is not leaf.tokens
            and (turn.end > leaf.prompt_len or leaf.tokens[: turn.end] != turn.tokens[: turn.end])
        ):
            return None
        # the list keys stay, in their order, as None for unpack_turns to fill
        packed.append((turn.summary(lists=False), i, m))
    # json, not orjson: orjson's output keeps its growth buffer (>= 4 KiB however short the text,
    # measured with tracemalloc), which would cost more than the summaries themselves
    return json.dumps(
        {"turns": packed, "parse_errors": parse_errors, "ignored_controls": ignored}, separators=(",", ":")
    )


def unpack_turns(
    packed: str, samples: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, int]]:
    """The turn summaries of `pack_turns` with their token lists back, from the session's samples
    (in `sample_ids` order; None: not in the spool any more, the lists stay null), and the
    session's parse-error and ignored-control counts."""
    data = json.loads(packed)
    turns = []
    for summary, i, m in data["turns"]:
        turns.append(summary)
        if samples is None:
            continue
        sample = samples[i]
        n = summary["prompt_len"]
        r = n - sample["prompt_len"]  # the output's start within the sample's response
        summary["prompt_ids"] = sample["tokens"][:n]
        summary["output_ids"] = sample["tokens"][n : n + m]
        summary["output_logprobs"] = sample["rollout_logprobs"][r : r + m]
    return turns, data["parse_errors"], data.get("ignored_controls", {})
