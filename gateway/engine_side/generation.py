"""What crosses the engine boundary, typed: a call's `SamplingParams`, and per sampled sequence its
`Generation` with its `FinishReason` and `VersionSpan`s.

The wire format stays SGLang's `/generate` JSON: `SamplingParams.to_wire()` is the
`sampling_params` object, key for key in the order the dialect set them with `max_new_tokens` last,
and `FinishReason.wire` is the engine's `meta_info.finish_reason` as it sent it, which turns, the
journal and samples record unchanged (`VersionSpan.to_wire()`: a `weight_versions` entry).
`RoutedExperts` is a mixture-of-experts engine's `meta_info.routed_experts` (asked with
`return_routed_experts`), decoded: the experts each position went to, from the position asked.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CONSTRAINTS", "FinishKind", "FinishReason", "Generation", "RoutedExperts", "SamplingParams", "VersionSpan",
    "constrained",
]  # fmt: skip

CONSTRAINTS = ("regex", "json_schema", "ebnf")
"""SGLang's constrained-decoding sampling fields: the engine masks the logits to the grammar before
it samples, and reports the logprobs of that masked distribution."""


def constrained(options: Mapping[str, Any]) -> bool:
    """Whether sampling `options` constrain the output (the turn's logprobs are the constrained ones)."""
    return any(options.get(key) for key in CONSTRAINTS)


@dataclass(frozen=True)
class SamplingParams:
    """SGLang `sampling_params` of one engine call: the dialect's options (already mapped to SGLang's
    names) and the token budget the core granted."""

    options: Mapping[str, Any]
    """Everything but `max_new_tokens`, in the order the dialect set it (`GenerationParams.sampling`)."""
    max_new_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {**self.options, "max_new_tokens": self.max_new_tokens}

    def after(self, done: int) -> SamplingParams | None:
        """The parameters of a continuation after `done` kept tokens (partial rollouts); None when the
        budget is spent. Each interrupted choice continues on its own (no `n`), and `min_new_tokens`
        counts what was already sampled."""
        left = self.max_new_tokens - done
        if left <= 0:
            return None
        options = {k: v for k, v in self.options.items() if k != "n"}
        if options.get("min_new_tokens"):
            options["min_new_tokens"] = max(0, int(options["min_new_tokens"]) - done)
        return SamplingParams(options, left)


class FinishKind(enum.StrEnum):
    """SGLang's `finish_reason.type`."""

    STOP = "stop"  # a stop token (`matched`: its id) or stop string (`matched`: the string)
    LENGTH = "length"  # the budget (`length`: max_new_tokens)
    ABORT = "abort"  # aborted: a refusal (`status_code` set) or a pause / `/abort_request` (none)


@dataclass(frozen=True)
class FinishReason:
    """Why a sequence ended: the engine's `meta_info.finish_reason` object, read once."""

    wire: dict[str, Any]
    """The object as the engine sent it (what a turn records)."""

    @classmethod
    def of(cls, wire: dict[str, Any] | None) -> FinishReason:
        """`wire`, or an abort saying it was missing."""
        return cls(wire or {"type": "abort", "message": "missing finish_reason"})

    @classmethod
    def length(cls, max_new_tokens: int) -> FinishReason:
        return cls({"type": "length", "length": max_new_tokens})

    @property
    def kind(self) -> str:
        """`FinishKind`'s value, or what an engine sent that is none of them."""
        return str(self.wire.get("type", FinishKind.STOP))

    @property
    def matched(self) -> int | str | None:
        """A stop's matched token id or string (None for other kinds)."""
        return self.wire.get("matched") if self.kind == FinishKind.STOP else None

    @property
    def stopped_on_token(self) -> bool:
        return isinstance(self.matched, int)

    @property
    def interrupted(self) -> bool:
        """An abort that is a successful answer (no status code): a pause-abort or `/abort_request`,
        not a refusal."""
        return self.kind == FinishKind.ABORT and self.wire.get("status_code") is None

    def with_length(self, max_new_tokens: int) -> FinishReason:
        """A `length` finish reporting the call's budget (a continuation's own is smaller)."""
        if self.kind != FinishKind.LENGTH or not max_new_tokens:
            return self
        return FinishReason({**self.wire, "length": max_new_tokens})


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens [start, end) sampled by weight version `version` (SGLang's `weight_versions`)."""

    version: str
    start: int
    end: int

    @classmethod
    def of(cls, wire: Mapping[str, Any]) -> VersionSpan:
        return cls(str(wire["version"]), int(wire["start"]), int(wire["end"]))

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class RoutedExperts:
    """The experts positions [start, start + len(experts)) of a sequence were routed to, per layer:
    `experts` [n, layers, top_k], kept compact (uint8 while the expert ids fit, else uint16)."""

    start: int
    experts: np.ndarray

    @property
    def end(self) -> int:
        """The first position not covered."""
        return self.start + len(self.experts)

    @classmethod
    def of(cls, start: int, experts: np.ndarray) -> RoutedExperts:
        experts = np.asarray(experts)
        top = int(experts.max()) if experts.size else 0
        return cls(start, np.ascontiguousarray(experts, dtype=np.uint8 if top < 256 else np.uint16))

    @classmethod
    def from_wire(cls, data: Any, start: int, layers: int, top_k: int) -> RoutedExperts:
        """SGLang's `meta_info.routed_experts`: base64 of little-endian int32 [n, layers, top_k]."""
        try:
            flat = np.frombuffer(base64.b64decode(data, validate=True), dtype="<i4")
        except (binascii.Error, TypeError, ValueError) as exc:
            raise ValueError(f"routed_experts is not base64 of int32s: {exc}") from None
        if flat.size % (layers * top_k) or (flat.size and flat.min() < 0):
            raise ValueError(
                f"routed_experts holds {flat.size} expert ids, not rows of {layers} layers x {top_k} "
                "non-negative experts"
            )
        return cls.of(start, flat.reshape(-1, layers, top_k))

    def then(self, rest: RoutedExperts) -> RoutedExperts:
        """These positions followed by `rest`'s, which must start where these end."""
        if rest.start != self.end:
            raise ValueError(f"routing of positions [{self.start}, {self.end}) then from {rest.start}")
        return RoutedExperts.of(self.start, np.concatenate([self.experts, rest.experts]))

    def to_wire(self) -> dict[str, Any]:
        """The journal's form: start, shape, dtype, base64."""
        return {
            "start": self.start,
            "shape": list(self.experts.shape),
            "dtype": self.experts.dtype.name,
            "data": base64.b64encode(self.experts.tobytes()).decode("ascii"),
        }

    @classmethod
    def from_journal(cls, wire: Mapping[str, Any]) -> RoutedExperts:
        raw = np.frombuffer(base64.b64decode(wire["data"]), dtype=np.dtype(wire["dtype"]))
        return cls(int(wire["start"]), raw.reshape(wire["shape"]))


@dataclass
class Generation:
    """One sampled sequence as the engine returned it."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]] | None
    finish_reason: FinishReason
    weight_version: str
    cached_tokens: int = 0
    weight_versions: list[VersionSpan] = field(default_factory=list)
    """Which version sampled which tokens, when more than one did (empty: all `weight_version`)."""
    routed: RoutedExperts | None = None
    """The routed experts, when the call asked for them (a continuation's joined on: partial.py)."""
