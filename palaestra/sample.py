"""The `Sample`: the only record that crosses from the gateway to the trainer.

One sample is one linear token sequence of a session: prompt tokens, then response tokens, where
the response interleaves what the policy sampled (loss_mask 1, with the engine's logprobs) and what
the environment or the chat template inserted (tool results, turn delimiters: loss_mask 0, logprob
0). A session whose history stops being an append-only extension forks into several samples of
the same group; each fork records its reason.

A mixture-of-experts policy's sample can carry the experts the rollout engine routed each token
to (`routed_experts`: [tokens, layers, top_k] over prompt and response, packed as the smallest
unsigned integer type that holds the expert ids, base64 in JSON), which the trainer replays
(`trainer.routing_replay: r3`) so that training uses the experts that sampled.

The schema is versioned (`SCHEMA_VERSION`); `Sample.from_dict` refuses other major versions with a
clear error. Invariants are checked on construction and on every append, with the actual lengths
in the message.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

SCHEMA_VERSION = "1.2"  # 1.1: routed_experts; 1.2: constrained
Status = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")


class SampleError(ValueError):
    """A Sample whose fields disagree (lengths, statuses, schema version)."""


def sample_id_for(session_id: str, fork_index: int) -> str:
    """Deterministic id: the same session and fork always give the same id (consumers deduplicate)."""
    digest = hashlib.sha256(f"{session_id}/{fork_index}".encode()).hexdigest()[:16]
    return f"{session_id}-{fork_index}-{digest}"


def _zeros_and_ones(mask: Any) -> bool:
    """Whether every entry of `mask` is 0 or 1 (`m in (0, 1)`: ints, bools, 1.0, numpy's scalars).
    A list of ints is checked at C speed: `bytearray` takes each entry's integer value (refusing
    anything without one, or outside 0..255) and `translate` deletes the 0s and 1s, so nothing is left
    exactly when each was 0 or 1 (an int's, a bool's or a numpy integer's value is what it equals);
    a Python loop over a long session's mask cost ~3-8 ms at its finish.
    Anything else (floats, numpy bools, None, strings, another container: `bytearray` would read an
    array's raw buffer) takes the loop."""
    if type(mask) is list:
        try:
            if not bytearray(mask).translate(None, b"\x00\x01"):
                return True
        except (TypeError, ValueError):
            pass
    return all(m in (0, 1) for m in mask)


def _last_sampled(mask: Any) -> int:
    """The index of the mask's last true entry, -1 if none: `rstrip` of the `bytearray` of a list of
    ints drops its trailing zeros at C speed (an int's truth is its value's); anything else loops."""
    if type(mask) is list:
        try:
            return len(bytearray(mask).rstrip(b"\x00")) - 1
        except (TypeError, ValueError):
            pass
    return max((i for i, m in enumerate(mask) if m), default=-1)


@dataclass
class Sample:
    sample_id: str
    session_id: str
    group_id: str
    env: str
    task_id: str
    tokens: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 = sampled by the policy
    rollout_logprobs: list[float] = field(default_factory=list)  # per response token; 0.0 where masked
    weight_versions: list[str] = field(default_factory=list)  # per response token ("" where masked)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    status: Status = "completed"
    fork_index: int = 0
    fork_reason: str | None = None  # why this sample started (None for the first)
    teacher_logprobs: list[float] | None = None  # per response token, filled by teacher scoring
    teacher: str | None = None
    # {"shape": [n, layers, top_k], "dtype": "uint8" | "uint16" | "int32", "data": base64}: the
    # rollout engine's expert choice per token (MoE policies with routing replay); see `routing()`.
    routed_experts: dict[str, Any] | None = None
    constrained: list[int] | None = None
    """Per response token, 1 where the policy sampled it under a decoding constraint (regex, JSON
    schema, grammar): the engine's logprob is then of the constrained distribution, which the
    trainer does not compute, so these tokens stay out of the mismatch metrics and of TIS / RS
    (trainer/objective.py). None: no token was."""
    schema_version: str = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.validate()

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> None:
        n = self.response_len
        if self.prompt_len < 0 or n < 0:
            raise SampleError(f"prompt_len {self.prompt_len} outside tokens of length {len(self.tokens)}")
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            got = len(getattr(self, name))
            if got != n:
                raise SampleError(
                    f"{name} has {got} entries for {n} response tokens (sample {self.sample_id})"
                )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise SampleError(
                f"teacher_logprobs has {len(self.teacher_logprobs)} entries for {n} response tokens"
            )
        if self.routed_experts is not None:
            self._check_routing_shape(self.routed_experts.get("shape"))
        if self.constrained is not None and len(self.constrained) != n:
            raise SampleError(
                f"constrained has {len(self.constrained)} entries for {n} response tokens (sample {self.sample_id})"
            )
        if not _zeros_and_ones(self.loss_mask):
            raise SampleError("loss_mask entries must be 0 or 1")
        if self.status not in STATUSES:
            raise SampleError(f"status {self.status!r} is not one of {STATUSES}")

    def append(
        self,
        tokens: list[int],
        *,
        sampled: bool,
        logprobs: list[float] | None = None,
        weight_version: str = "",
    ) -> None:
        """Appends response tokens, keeping mask, logprobs and versions aligned."""
        if sampled:
            if logprobs is None or len(logprobs) != len(tokens):
                got = None if logprobs is None else len(logprobs)
                raise SampleError(f"{len(tokens)} sampled tokens need as many logprobs, got {got}")
        elif logprobs is not None:
            raise SampleError("non-sampled tokens carry no logprobs")
        self.tokens.extend(tokens)
        self.loss_mask.extend([1 if sampled else 0] * len(tokens))
        self.rollout_logprobs.extend(logprobs if sampled else [0.0] * len(tokens))
        self.weight_versions.extend([weight_version if sampled else ""] * len(tokens))

    def _check_routing_shape(self, shape: Any) -> None:
        """Routing covers every position that a trained token's logprob depends on: a token at
        position p is predicted from positions 0..p-1, so the rows must reach the last sampled
        token's position (the engine never runs the last token it sampled through the model)."""
        need = self.prompt_len + _last_sampled(self.loss_mask)
        if not (
            isinstance(shape, (list, tuple))
            and len(shape) == 3
            and all(isinstance(d, int) for d in shape)
            and need <= shape[0] <= len(self.tokens)
        ):
            raise SampleError(
                f"routed_experts has shape {list(shape) if isinstance(shape, (list, tuple)) else shape} "
                f"for {len(self.tokens)} tokens; expected [n, layers, top_k] with {max(need, 0)} <= n <= "
                f"{len(self.tokens)} (sample {self.sample_id})"
            )

    def set_routing(self, routing: np.ndarray) -> None:
        """Stores the per-position expert ids [n, layers, top_k] (the first n positions of
        `tokens`) in the smallest unsigned type they fit."""
        routing = np.asarray(routing)
        self._check_routing_shape(list(routing.shape))
        if routing.size and (routing.min() < 0):
            raise SampleError(f"routing holds a negative expert id (sample {self.sample_id})")
        top = int(routing.max()) if routing.size else 0
        dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.int32
        packed = np.ascontiguousarray(routing, dtype=dtype)
        self.routed_experts = {
            "shape": list(routing.shape),
            "dtype": np.dtype(dtype).name,
            "data": base64.b64encode(packed.tobytes()).decode("ascii"),
        }

    def routing(self) -> np.ndarray | None:
        """The expert ids [n, layers, top_k] as int64 (n <= len(tokens): positions past n follow the
        trainer's own routing), or None when the sample carries none."""
        if self.routed_experts is None:
            return None
        raw = base64.b64decode(self.routed_experts["data"])
        flat = np.frombuffer(raw, dtype=np.dtype(self.routed_experts["dtype"]))
        return flat.reshape(self.routed_experts["shape"]).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_record(self) -> dict[str, Any]:
        """The fields as a dict that holds this sample's own lists, uncopied (`to_dict` deep-copies
        every token list: for a record written out at once, such as the gateway's spool line)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        version = str(data.get("schema_version", ""))
        if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise SampleError(f"sample schema {version!r} is not readable by schema {SCHEMA_VERSION}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
