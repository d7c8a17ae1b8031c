"""A session's trajectory tree and its linearisation into Samples.

Every sampled choice of every call is a `Turn`. A turn that continues an earlier one (the agent
sent back exactly what the model produced, plus new messages) is its child, and its prompt is the
parent's prompt + the parent's exact output ids + the template's tokens for the new messages. A
turn that cannot continue anything starts a new root: a *fork*, with a named reason.

At reward time each leaf becomes one `Sample`: tokens = the leaf's prompt + output; loss_mask 1
exactly on the output ids of the turns along its path, 0 on everything between them (template and
tool tokens); rollout_logprobs and weight_versions aligned with it. With routed experts asked, the
sample also carries the experts of positions [0, prompt + output - 1) of the leaf (the last token
never went through the model), joined from the turns along its path: the root's from 0, each child's
from where its parent's ended. A gap or a shape that differs is a `RoutingError` naming the session
(the service drops that sample with the reason), never a sample trained on wrong routing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, overload

import numpy as np

from palaestra.gateway.engine_side.generation import FinishKind, FinishReason, RoutedExperts, VersionSpan
from palaestra.sample import Sample, sample_id_for

FORK_REASONS = (
    "prefix_changed",  # earlier messages edited, dropped or compacted
    "assistant_edited",  # the agent changed what the model said
    "template_nonmonotonic",  # the template renders the shared history differently once extended
    "reasoning_stripped",  # the template drops reasoning the model produced
    "branched",  # a second continuation of the same turn (retries, n > 1 picks)
)


class PromptIds(Sequence[int]):
    """A prompt that extends a turn, known by construction and not copied: `base[:start] + tail`,
    where `base` is the turn's `tokens` list and `start` its `end` (`Turn.extended`). A `Turn.tokens`
    list only grows, so its first `start` ids stay what they were: the turn recorded from this
    prompt appends `tail` to `base` without comparing the history, and `EncodedIds` writes the engine
    request's JSON from the JSON it wrote for `base` before. Where a list is needed (a fork's JSON, a
    continuation's prompt) `list_of` makes one; at 100k ids that copy and its release cost about as
    much as writing the new ids' JSON, so the bridged path never makes it."""

    __slots__ = ("base", "start", "tail")

    def __init__(self, base: list[int], start: int, tail: list[int]) -> None:
        self.base, self.start, self.tail = base, start, tail

    def __len__(self) -> int:
        return self.start + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.list()[i]
        k = i + len(self) if i < 0 else i
        if not 0 <= k < len(self):
            raise IndexError(f"prompt id {i} of {len(self)}")
        return self.base[k] if k < self.start else self.tail[k - self.start]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self.base, self.start), self.tail)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            other = other.list()
        return isinstance(other, list) and len(other) == len(self) and self.list() == other

    __hash__ = None  # type: ignore[assignment]  # a list's value: not hashable

    def __add__(self, other: list[int]) -> list[int]:
        return self.list() + other

    def __repr__(self) -> str:
        return f"PromptIds({self.start} ids of a turn's tokens + {self.tail!r})"

    def list(self) -> list[int]:
        """The ids as a list of their own (a copy)."""
        return (self.base if len(self.base) == self.start else self.base[: self.start]) + self.tail


def list_of(ids: Sequence[int]) -> list[int]:
    """`ids` as a list: itself where it is one, a copy of a `PromptIds`' ids."""
    if isinstance(ids, list):
        return ids
    return ids.list() if isinstance(ids, PromptIds) else list(ids)


@dataclass
class Turn:
    turn_id: int
    call_id: str
    choice: int
    parent: Turn | None
    prompt_ids: InitVar[Sequence[int]]  # a list or a `PromptIds`, kept in `tokens` (read it with `prompt()`)
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: str
    weight_spans: list[VersionSpan]  # which version sampled which output tokens (empty: weight_version)
    finish_reason: FinishReason
    latency_s: float
    cached_tokens: int
    kind: str  # "chat" | "completion"
    n_messages: int = 0  # chat: request messages this turn answered
    digest: int | None = None  # chat: chain digest of those messages
    reply_digest: int | None = None  # chat: digest of the assistant message we returned
    rendered: str = ""  # chat: the template text of the prompt; completion: prompt + output text
    output_text: str = ""  # decoded output incl. special tokens
    had_reasoning: bool = False
    context_key: int | None = None  # chat: digest of what the template reads besides the messages
    parse: dict[str, Any] | None = None  # chat: how the output was parsed (service._parse_status)
    controls: dict[str, Any] | None = None
    """What the call asked that was not done as asked (service._controls): "ignored" (the recorded
    controls, gateway/dialects/controls.py) and "max_tokens" (a clamp: field, asked, granted); None: nothing."""
    routed: RoutedExperts | None = None  # the experts the engine routed positions [start, end) to
    constrained: bool = False  # sampled under a decoding constraint: the logprobs are the constrained ones
    fork_reason: str | None = None  # why this turn starts a new sample (None: continues or first)
    fork_detail: str = ""
    children: int = 0
    created: float = field(default_factory=time.time)
    reasoning_on_path: bool = field(init=False, repr=False)
    """Whether this turn or an ancestor had reasoning: set once here, because the bridge asks on
    every call and walking `path()` would grow with the session."""
    tokens: list[int] = field(init=False, repr=False)
    """The token list whose first `prompt_len` ids are the prompt, followed by the output: one list
    along a chain of turns (each child's bridge and output appended to its parent's), so a session
    holds its tokens once, not once per turn (64 turns of a 100k-token history: 6.4 M list slots).
    Only ever appended to (`PromptIds` relies on it)."""
    prompt_len: int = field(init=False)

    def __post_init__(self, prompt_ids: Sequence[int]) -> None:
        self.reasoning_on_path = self.had_reasoning or (
            self.parent is not None and self.parent.reasoning_on_path
        )
        parent, self.prompt_len = self.parent, len(prompt_ids)
        end = parent.end if parent is not None else 0
        # the parent is its list's last turn and this prompt extends it: append (else a list of its
        # own: a root, a branch, or another choice of the same call). A `PromptIds` built on the
        # parent's list up to its end says so without comparing the history again.
        if parent is None or len(parent.tokens) != end or len(prompt_ids) < end:
            self.tokens = list_of(prompt_ids) + self.output_ids
        elif (
            isinstance(prompt_ids, PromptIds) and prompt_ids.base is parent.tokens and prompt_ids.start == end
        ):
            self.tokens = parent.tokens
            self.tokens += prompt_ids.tail
            self.tokens += self.output_ids
        else:
            prompt = list_of(prompt_ids)
            if prompt[:end] == parent.tokens:
                self.tokens = parent.tokens
                self.tokens += prompt[end:]
                self.tokens += self.output_ids
            else:
                self.tokens = prompt + self.output_ids

    @property
    def end(self) -> int:
        """Where this turn's output ends in `tokens`."""
        return self.prompt_len + len(self.output_ids)

    def extended(self, tail: list[int]) -> PromptIds:
        """The prompt of a turn that continues this one: its prompt and output, then `tail`."""
        return PromptIds(self.tokens, self.end, tail)

    def prompt(self) -> list[int]:
        """The prompt ids (a copy)."""
        return self.tokens[: self.prompt_len]

    @property
    def root(self) -> Turn:
        t = self
        while t.parent is not None:
            t = t.parent
        return t

    def path(self) -> list[Turn]:
        out, t = [], self
        while t is not None:
            out.append(t)
            t = t.parent
        return out[::-1]

    def summary(self, lists: bool = True) -> dict[str, Any]:
        """The turn as GET /sessions/{id} shows it; `lists=False`: `prompt_ids`, `output_ids` and
        `output_logprobs` None, in their places (what a finished session keeps,
        gateway/sessions/finished.py), without copying the prompt out of the session's token list
        (a 64-turn session whose history grows to 100k tokens: 3.2 M ids copied at its release only to
        be dropped)."""
        return {
            "turn_id": self.turn_id,
            "call_id": self.call_id,
            "choice": self.choice,
            "parent": self.parent.turn_id if self.parent else None,
            "kind": self.kind,
            "prompt_len": self.prompt_len,
            "prompt_ids": self.prompt() if lists else None,
            "output_ids": self.output_ids if lists else None,
            "output_logprobs": self.output_logprobs if lists else None,
            "weight_version": self.weight_version,
            # an answer a weight update interrupted and the new weights continued: which version
            # sampled which output tokens (empty: all `weight_version`)
            "weight_spans": [s.to_wire() for s in self.weight_spans],
            "finish_reason": self.finish_reason.wire,
            "latency_s": self.latency_s,
            "cached_tokens": self.cached_tokens,
            "fork_reason": self.fork_reason,
            "fork_detail": self.fork_detail,
            "parse": self.parse,
            "controls": self.controls,
            "constrained": self.constrained,
        }


class RoutingError(ValueError):
    """A leaf's routed experts do not cover its path exactly (a gap, an overlap, another shape)."""


def routing_start(parent: Turn | None) -> int:
    """The first position a turn's routed experts must cover: 0 for a root, else where its parent's
    ended (the parent's last output token never went through the model, so it is the child's)."""
    if parent is None:
        return 0
    return max(parent.end - 1, 0)


def path_routing(path: list[Turn], session_id: str) -> np.ndarray:
    """The experts of positions [0, prompt + output - 1) of the path's leaf, joined along the path."""
    leaf = path[-1]
    end = routing_start(leaf)
    pieces: list[np.ndarray] = []
    covered = 0
    for turn in path:
        routed = turn.routed
        if routed is None:
            raise RoutingError(f"session {session_id}: turn {turn.turn_id} has no routed experts")
        if routed.start != covered:
            raise RoutingError(
                f"session {session_id}: turn {turn.turn_id}'s routed experts start at position "
                f"{routed.start}, the turns before it cover [0, {covered})"
            )
        if pieces and routed.experts.shape[1:] != pieces[0].shape[1:]:
            raise RoutingError(
                f"session {session_id}: turn {turn.turn_id}'s routed experts have rows of shape "
                f"{list(routed.experts.shape[1:])}, earlier turns' {list(pieces[0].shape[1:])}"
            )
        pieces.append(routed.experts)
        covered = routed.end
    if covered != end:
        raise RoutingError(
            f"session {session_id}: routed experts cover positions [0, {covered}), the sample needs [0, {end})"
        )
    return np.concatenate(pieces)


def _versions(turn: Turn) -> list[str]:
    n = len(turn.output_ids)
    if not turn.weight_spans:
        return [turn.weight_version] * n
    out = [turn.weight_version] * n
    for span in turn.weight_spans:
        for i in range(span.start, min(span.end, n)):
            out[i] = span.version
    return out


def linearize(
    leaf: Turn,
    *,
    session_id: str,
    group_id: str,
    env: str,
    task_id: str,
    fork_index: int,
    reward: float,
    metrics: dict[str, float],
    status: str,
    routing: bool = False,
) -> Sample:
    """The leaf's sample; `routing`: with its routed experts (`path_routing`; RoutingError)."""
    path = leaf.path()
    root = path[0]
    prompt_len = root.prompt_len
    tokens = leaf.tokens[: leaf.end]
    n = len(tokens) - prompt_len
    mask = [0] * n
    logprobs = [0.0] * n
    versions = [""] * n
    constrained = [0] * n if any(t.constrained for t in path) else None
    for turn in path:
        start = turn.prompt_len - prompt_len
        end = start + len(turn.output_ids)
        assert tokens[start + prompt_len : end + prompt_len] == turn.output_ids, "turn tokens moved"
        mask[start:end] = [1] * len(turn.output_ids)
        logprobs[start:end] = turn.output_logprobs
        versions[start:end] = _versions(turn)
        if constrained is not None and turn.constrained:
            constrained[start:end] = [1] * len(turn.output_ids)
    if status == "completed" and leaf.finish_reason.kind == FinishKind.LENGTH:
        status = "truncated"
    if status == "completed" and leaf.finish_reason.kind == FinishKind.ABORT:
        status = "aborted"
    sample = Sample(
        sample_id=sample_id_for(session_id, fork_index),
        session_id=session_id,
        group_id=group_id,
        env=env,
        task_id=task_id,
        tokens=tokens,
        prompt_len=prompt_len,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        weight_versions=versions,
        reward=reward,
        metrics={**metrics, "turns": float(len(path))},
        status=status,
        fork_index=fork_index,
        fork_reason=next((t.fork_reason for t in reversed(path) if t.fork_reason), None),
        constrained=constrained,
    )
    if routing:
        sample.set_routing(path_routing(path, session_id))
    return sample
