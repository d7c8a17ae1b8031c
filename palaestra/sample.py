"""The `Sample`: the only record that crosses from the gateway to the trainer.

One sample is one linear token sequence of a session: prompt tokens, then response tokens, where
the response interleaves what the policy sampled (loss_mask 1, with the engine's logprobs) and what
the environment or the chat template inserted (tool results, turn delimiters: loss_mask 0, logprob
0). A session whose history stops being an append-only extension forks into several samples of
the same group; each fork records its reason.

The schema is versioned (`SCHEMA_VERSION`); `Sample.from_dict` refuses other major versions with a
clear error. Invariants are checked on construction and on every append, with the actual lengths
in the message.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SCHEMA_VERSION = "1.0"
Status = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")


class SampleError(ValueError):
    """A Sample whose fields disagree (lengths, statuses, schema version)."""


def sample_id_for(session_id: str, fork_index: int) -> str:
    """Deterministic id: the same session and fork always give the same id (consumers deduplicate)."""
    digest = hashlib.sha256(f"{session_id}/{fork_index}".encode()).hexdigest()[:16]
    return f"{session_id}-{fork_index}-{digest}"


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
    routed_experts: Any = None  # MoE routing the engine used: see the note below
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
        if any(m not in (0, 1) for m in self.loss_mask):
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

    # `routed_experts`: the experts the rollout engine's router chose, a numpy integer array
    # (int16) [len(tokens) or len(tokens) - 1, layers, top_k]: row t for the token at position t;
    # layers are the model's MoE layers in order, or all its layers (the engine's
    # meta_info.routed_experts, dense layers' rows ignored). The trainer replays it with
    # trainer.routing_replay = "r3" (trainer/moe.py); None when the engine did not report it.

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.routed_experts is not None:  # JSON has no arrays: nested lists
            data["routed_experts"] = self.routed_experts.tolist()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        version = str(data.get("schema_version", ""))
        if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise SampleError(f"sample schema {version!r} is not readable by schema {SCHEMA_VERSION}")
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in data.items() if k in known}
        if fields.get("routed_experts") is not None:
            import numpy as np

            fields["routed_experts"] = np.asarray(fields["routed_experts"], dtype=np.int16)
        return cls(**fields)
