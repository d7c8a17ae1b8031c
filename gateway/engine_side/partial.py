"""Partial rollouts: a generation that a weight update interrupted, continued where it stopped.

In async training the engines are paused with `/pause_generation {"mode": "abort"}` for each weight
sync while the gateway is paused without draining. Each engine call in flight then comes back as
SGLang answers a pause-abort: HTTP 200, `finish_reason {"type": "abort", "status_code": null}` and
the tokens sampled so far, with their logprobs and version. The turn is not over: once the gateway
is resumed (the new weights are loaded), the service sends the prompt plus those tokens again with
what is left of the budget, and joins the two answers into one `Generation` whose
`weight_versions` spans say which tokens each version sampled (with routed experts asked, the
continuation asks them from where the interrupted part's ended, so the new tokens carry the new
version's routing) (`turns.py` runs the loop;
`FinishReason.interrupted` says which answers it continues, `SamplingParams.after` with what). The client sees one answer; the
sample's per-token versions and behaviour logprobs are what the trainer's staleness bound and
TIS/RS read.

The continuation is what the engine would have produced had the version switched at that token:
the prompt and the kept tokens are prefilled again under the new weights (the update flushed the
prefix cache). Sampling restarts its random stream at the continuation (a seeded call is therefore
reproducible but not the same as one never interrupted), and a stop string written across the
seam is not seen by the engine (the gateway's own stop trimming still sees the whole text).
"""

from __future__ import annotations

from palaestra.gateway.engine_side.generation import FinishReason, Generation, VersionSpan

__all__ = ["continued"]


def _spans(gen: Generation, offset: int) -> list[VersionSpan]:
    spans = gen.weight_versions or [VersionSpan(gen.weight_version, 0, len(gen.output_ids))]
    return [VersionSpan(s.version, s.start + offset, s.end + offset) for s in spans if s.end > s.start]


def continued(first: Generation, rest: Generation | None, max_new_tokens: int = 0) -> Generation:
    """`first`'s tokens followed by `rest`'s, one answer; `rest` None: the budget was spent at the
    interruption (finish `length`)."""
    if rest is None:
        return Generation(
            output_ids=first.output_ids,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            finish_reason=FinishReason.length(max_new_tokens),
            weight_version=first.weight_version,
            cached_tokens=first.cached_tokens,
            weight_versions=first.weight_versions,
            routed=first.routed,
        )
    spans: list[VersionSpan] = []
    for s in _spans(first, 0) + _spans(rest, len(first.output_ids)):
        if spans and spans[-1].version == s.version and spans[-1].end == s.start:
            spans[-1] = VersionSpan(s.version, spans[-1].start, s.end)
        else:
            spans.append(s)
    tops = None
    if first.top_logprobs is not None and rest.top_logprobs is not None:
        tops = first.top_logprobs + rest.top_logprobs
    return Generation(
        output_ids=first.output_ids + rest.output_ids,
        logprobs=first.logprobs + rest.logprobs,
        top_logprobs=tops,
        finish_reason=rest.finish_reason.with_length(
            max_new_tokens
        ),  # the call's budget, not the continuation's
        weight_version=rest.weight_version,
        cached_tokens=first.cached_tokens,
        weight_versions=spans if len(spans) > 1 else [],
        routed=first.routed.then(rest.routed)
        if first.routed is not None and rest.routed is not None
        else None,
    )
