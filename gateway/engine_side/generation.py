"""What crosses the engine boundary, typed: a call's `SamplingParams`, and per sampled sequence its
`Generation` with its `FinishReason` and `VersionSpan`s.

The wire format stays SGLang's `/generate` JSON: `SamplingParams.to_wire()` is the
`sampling_params` object, key for key in the order the dialect set them with `max_new_tokens` last,
and `FinishReason.wire` is the engine's `meta_info.finish_reason` as it sent it, which turns, the
journal and samples record unchanged (`VersionSpan.to_wire()`: a `weight_versions` entry).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinishKind", "FinishReason", "Generation", "SamplingParams", "VersionSpan"]


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
