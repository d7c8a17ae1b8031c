"""Forks stored as what they add to an earlier record: the spool's samples and the journal's prompts.

A session that forks k times has k + 1 samples that begin alike (the history before each fork), and
each fork's first turn has a prompt that repeats an earlier turn's tokens. Stored whole, the common
prefix is written k + 1 times. Instead, the spool (gateway/sessions/spool.py) stores a forked
sample as a reference to an earlier sample of the same session, the number `n` of leading tokens
the two share, and the rest (`delta`): `tokens[n:]`, and of each per-response list the entries of
positions n and after. A reader gets the sample back field for field (`expand`). The journal
(gateway/sessions/journal.py) stores a fork's prompt the same way against an earlier turn's prompt
and output (`shared_with_turn`).

Per-response lists (`PER_RESPONSE`) start at the sample's `prompt_len`, so a prefix that reaches
into the response (a retry that branched after some turns: same root, same prompt_len) is shared
only as far as every per-response list also agrees with the parent's at the same positions; a
sample whose prompt is longer than the parent's (a fork's root prompt holds the history) shares
its prompt and stores its response lists whole. `routed_experts` (MoE routing replay) is stored
whole.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MIN_SHARED", "PER_RESPONSE", "common_prefix", "delta", "expand", "shared_with_turn"]

MIN_SHARED = 16
"""A shorter common prefix is not worth a reference: the record is stored whole."""

PER_RESPONSE = ("loss_mask", "rollout_logprobs", "weight_versions", "constrained", "teacher_logprobs")
"""The sample's lists with one entry per response token (None: absent)."""

_BLOCK = 512


def common_prefix(a: list[Any], b: list[Any]) -> int:
    """The length of the longest common prefix of `a` and `b`, compared a block at a time (slice
    equality runs in C: a Python step per token would cost ~1 ms per 8k-token sample)."""
    n, i = min(len(a), len(b)), 0
    while i < n:
        j = min(i + _BLOCK, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _shareable(sample: dict[str, Any], parent: dict[str, Any], n: int) -> int:
    """`n` (the common token prefix) cut back to where every per-response list agrees too."""
    mine_start, theirs_start = sample["prompt_len"], parent["prompt_len"]
    if n <= mine_start:
        return n
    if theirs_start > mine_start:  # positions that are response here are prompt there
        return mine_start
    offset = mine_start - theirs_start
    for name in PER_RESPONSE:
        mine, theirs = sample.get(name), parent.get(name)
        if mine is None:
            continue
        if theirs is None:
            return mine_start
        n = min(n, mine_start + common_prefix(mine, theirs[offset:]))
    return n


def delta(sample: dict[str, Any], parent: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """`sample` (a `Sample.to_dict()`) as (n, what it adds to `parent`'s first n tokens), or None
    when they share fewer than `MIN_SHARED` tokens. `expand(part, n, parent)` gives `sample` back."""
    n = _shareable(sample, parent, common_prefix(sample["tokens"], parent["tokens"]))
    if n < MIN_SHARED:
        return None
    part = dict(sample)
    part["tokens"] = sample["tokens"][n:]
    cut = max(n - sample["prompt_len"], 0)
    for name in PER_RESPONSE:
        if sample.get(name) is not None:
            part[name] = sample[name][cut:]
    return n, part


def expand(part: dict[str, Any], n: int, parent: dict[str, Any]) -> dict[str, Any]:
    """The sample that `delta` stored as `part` against `parent` (whole: expanded already)."""
    sample = dict(part)
    sample["tokens"] = parent["tokens"][:n] + part["tokens"]
    mine_start = part["prompt_len"]
    if n > mine_start:
        lo, hi = mine_start - parent["prompt_len"], n - parent["prompt_len"]
        for name in PER_RESPONSE:
            if part.get(name) is not None:
                sample[name] = parent[name][lo:hi] + part[name]
    return sample


class _Tokens(Protocol):
    tokens: list[int]
    end: int


def shared_with_turn(prompt: list[int], turn: _Tokens) -> int:
    """How many leading tokens `prompt` shares with `turn`'s prompt + output (the first `end` of
    its token list, which later turns of its chain may extend)."""
    return min(common_prefix(prompt, turn.tokens), turn.end)
