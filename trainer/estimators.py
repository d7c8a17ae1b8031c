"""The table of advantage estimators, and what an estimator is: one function and one config value.

    trainer:
      advantage_estimator: grpo                        # a name from ESTIMATORS
      advantage_estimator: mypkg.rloo:leave_one_out    # or a function of yours, by import path

An estimator turns one step's rewards into one advantage per sample:

    def leave_one_out(ctx: AdvantageContext) -> torch.Tensor:   # shape [ctx.num_samples]
        ...

`ctx` (`AdvantageContext`) holds the step's samples as parallel columns — rewards, group and
session ids, sampled-token counts — and the knobs an estimator may use (`eps`). The trainer
broadcasts sample i's advantage to every response token of sample i, then adds the per-token
terms (on-policy distillation, KL as a reward penalty) and trains with PPO-clip (objective.py).
A returned tensor of another shape is an error naming the estimator, and so is one with NaN/inf
entries from an import-path estimator (the built-ins are left as they always were).

The table maps each name to the import path of its function (like the model preset table,
palaestra/models/registry.py), so reading it imports nothing; the built-ins live in
trainer/advantages.py next to their formulas, and a name or a path is resolved the same way,
by `palaestra.plugins.load_object`. `TrainerConfig` checks the value when it is loaded (a name
not in the table and not an import path is an error listing the names; a path is imported then).
docs/trainer.md has a worked example.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from palaestra.sample import Sample

__all__ = ["ESTIMATORS", "AdvantageContext", "Estimator", "estimate", "load_estimator"]


@dataclass(frozen=True)
class AdvantageContext:
    """What an advantage estimator sees of one step: N samples, in the step's order (every DP rank
    sees all of them, so an estimator needs no communication)."""

    rewards: torch.Tensor
    """`Sample.reward` of each sample, [N] float32."""

    group_ids: tuple[str, ...]
    """`Sample.group_id`: the samples of one task that are compared with each other."""

    session_ids: tuple[str, ...]
    """`Sample.session_id`: a session whose history was rewritten forks into several samples with
    one session id and one reward; it is still one rollout (count it once in group statistics)."""

    sampled_tokens: torch.Tensor
    """`Sample.num_sampled`: each sample's policy-sampled (loss-mask) tokens, [N] float32 — the
    tokens its advantage trains."""

    eps: float
    """`TrainerConfig.advantage_eps`: the eps of a std division."""

    @property
    def num_samples(self) -> int:
        return len(self.group_ids)

    @classmethod
    def of(cls, samples: Sequence[Sample], eps: float) -> AdvantageContext:
        import torch

        return cls(
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            group_ids=tuple(s.group_id for s in samples),
            session_ids=tuple(s.session_id for s in samples),
            sampled_tokens=torch.tensor([s.num_sampled for s in samples], dtype=torch.float32),
            eps=eps,
        )


Estimator = Callable[[AdvantageContext], "torch.Tensor"]

_BUILTIN = "palaestra.trainer.advantages"

ESTIMATORS: dict[str, str] = {
    "grpo": f"{_BUILTIN}:grpo_estimator",  # (r − mean_g) / (std_g + eps)
    "dr_grpo": f"{_BUILTIN}:dr_grpo_estimator",  # r − mean_g
    "reinforce_pp_baseline": f"{_BUILTIN}:reinforce_pp_estimator",  # r − mean_g, whitened over tokens
    "sft": f"{_BUILTIN}:sft_estimator",  # 1 (supervised fine-tuning on the given responses)
    "none": f"{_BUILTIN}:zero_estimator",  # 0 (pure on-policy distillation with opd.kl_coef > 0)
}
"""Name -> ``package.module:function`` of each built-in estimator (an `Estimator`)."""


def estimator_path(name: str) -> str:
    """The import path of `name`: a table entry's, or `name` itself when it is an import path."""
    from palaestra.plugins import is_import_path

    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if isinstance(name, str) and is_import_path(name):
        return name
    close = difflib.get_close_matches(str(name), list(ESTIMATORS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"advantage_estimator {name!r}: expected one of {', '.join(ESTIMATORS)}{hint}, or the import "
        "path 'package.module:function' of an estimator(ctx: AdvantageContext) -> Tensor[N] "
        "(docs/trainer.md)"
    )


def load_estimator(name: str) -> Estimator:
    """The estimator function of a table name or an import path (imported now); a ValueError
    (`PluginError` for a path that does not load) says what to change."""
    from palaestra.plugins import load_object

    return load_object(estimator_path(name), "advantage_estimator", callable_=True)


def estimate(estimator: Estimator, ctx: AdvantageContext, name: str) -> torch.Tensor:
    """`estimator(ctx)`, checked: one finite advantage per sample, [N] float32."""
    import torch

    out = estimator(ctx)
    n = ctx.num_samples
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n,):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"advantage_estimator {name!r} returned {got} for {n} samples; an estimator returns one "
            f"advantage per sample, a tensor of shape ({n},)"
        )
    if name not in ESTIMATORS and not bool(torch.isfinite(out).all()):
        bad = [i for i, ok in enumerate(torch.isfinite(out).tolist()) if not ok]
        raise ValueError(
            f"advantage_estimator {name!r} returned non-finite advantages for samples {bad[:8]} "
            f"(rewards {[float(ctx.rewards[i]) for i in bad[:8]]}); every advantage must be finite"
        )
    return out.to(torch.float32)
