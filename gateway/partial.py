"""Partial rollouts: a generation that a weight update interrupted, continued where it stopped.

In async training the engines are paused with `/pause_generation {"mode": "abort"}` for each weight
sync while the gateway is paused without draining. Each engine call in flight then comes back as
SGLang answers a pause-abort: HTTP 200, `finish_reason {"type": "abort", "status_code": null}` and
the tokens sampled so far, with their logprobs and version. The turn is not over: once the gateway
is resumed (the new weights are loaded), the service sends the prompt plus those tokens again with
what is left of the budget, and joins the two answers into one `Generation` whose
`weight_versions` spans say which tokens each version sampled. The client sees one answer; the
sample's per-token versions and behaviour logprobs are what the trainer's staleness bound and
TIS/RS read.

The continuation is what the engine would have produced had the version switched at that token:
the prompt and the kept tokens are prefilled again under the new weights (the update flushed the
prefix cache). Sampling restarts its random stream at the continuation (a seeded call is therefore
reproducible but not the same as one never interrupted), and a stop string written across the
seam is not seen by the engine (the gateway's own stop trimming still sees the whole text).
"""

from __future__ import annotations

from typing import Any

from palaestra.gateway.engine_client import Generation

__all__ = ["continued", "interrupted", "remaining"]


def interrupted(gen: Generation) -> bool:
    """An abort that is a successful answer (no status code): a pause-abort or `/abort_request`,
    not a refusal. The service continues it only when a pause began during the call."""
    fr = gen.finish_reason
    return fr.get("type") == "abort" and fr.get("status_code") is None


def remaining(sampling: dict[str, Any], done: int) -> dict[str, Any] | None:
    """The sampling parameters of the continuation after `done` kept tokens; None when the budget
    is spent (the call ends as `length`)."""
    left = int(sampling.get("max_new_tokens") or 0) - done
    if left <= 0:
        return None
    rest = {**sampling, "max_new_tokens": left}
    rest.pop("n", None)  # each interrupted choice continues on its own
    if rest.get("min_new_tokens"):
        rest["min_new_tokens"] = max(0, int(rest["min_new_tokens"]) - done)
    return rest


def _spans(gen: Generation, offset: int) -> list[dict[str, Any]]:
    n = len(gen.output_ids)
    spans = gen.weight_versions or [{"version": gen.weight_version, "start": 0, "end": n}]
    return [
        {"version": str(s["version"]), "start": int(s["start"]) + offset, "end": int(s["end"]) + offset}
        for s in spans
        if int(s["end"]) > int(s["start"])
    ]


def continued(first: Generation, rest: Generation | None, max_new_tokens: int = 0) -> Generation:
    """`first`'s tokens followed by `rest`'s, one answer; `rest` None: the budget was spent at the
    interruption (finish `length`)."""
    if rest is None:
        return Generation(
            output_ids=first.output_ids,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            finish_reason={"type": "length", "length": max_new_tokens},
            weight_version=first.weight_version,
            cached_tokens=first.cached_tokens,
            weight_versions=first.weight_versions,
        )
    spans: list[dict[str, Any]] = []
    for s in _spans(first, 0) + _spans(rest, len(first.output_ids)):
        if spans and spans[-1]["version"] == s["version"] and spans[-1]["end"] == s["start"]:
            spans[-1]["end"] = s["end"]
        else:
            spans.append(s)
    finish = rest.finish_reason
    if finish.get("type") == "length" and max_new_tokens:
        finish = {**finish, "length": max_new_tokens}  # the call's budget, not the continuation's
    tops = None
    if first.top_logprobs is not None and rest.top_logprobs is not None:
        tops = first.top_logprobs + rest.top_logprobs
    return Generation(
        output_ids=first.output_ids + rest.output_ids,
        logprobs=first.logprobs + rest.logprobs,
        top_logprobs=tops,
        finish_reason=finish,
        weight_version=rest.weight_version,
        cached_tokens=first.cached_tokens,
        weight_versions=spans if len(spans) > 1 else [],
    )
