"""A session's turns as text: what ``GET /sessions/{id}?text=true`` adds to the trajectory.

Each turn gets ``text``: ``context``, the prompt tokens it added to what its parent's path already
held (a root turn: its whole rendered prompt, system prompt and chat template markers included; a
child: the tool results or user message after the parent's reply), ``reply``, its output, and
``from``, where ``context`` starts in its prompt (for a child, short of the parent's prompt +
output when the client's history differed from what was sampled, which is where a fork starts).
`palaestra session show` and `palaestra rollout --show` print it. Special tokens are kept, so the
text is what the model read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["with_text"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def with_text(trajectory: dict[str, Any], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """`trajectory` (GET /sessions/{id}) with each turn's ``text`` (module docstring); turns whose
    token lists are gone (null: no longer in the spool) get ``text: null``."""
    by_id = {t["turn_id"]: t for t in trajectory["turns"]}
    turns = []
    for turn in trajectory["turns"]:
        prompt, output = turn.get("prompt_ids"), turn.get("output_ids")
        parent = by_id.get(turn.get("parent"))
        if prompt is None or output is None:
            turns.append({**turn, "text": None})
            continue
        start = 0
        if parent is not None and parent.get("prompt_ids") is not None:
            start = _common_prefix(prompt, [*parent["prompt_ids"], *(parent.get("output_ids") or [])])
        text = {"from": start, "context": decode(list(prompt[start:])), "reply": decode(list(output))}
        turns.append({**turn, "text": text})
    return {**trajectory, "turns": turns}
