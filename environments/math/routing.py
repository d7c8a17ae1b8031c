"""Teacher routing for math runs that mix task kinds: one teacher per kind.

    trainer:
      opd:
        teachers:
          arithmetic:   {mode: megatron, model: demo-teacher}
          worked_steps: {mode: megatron, model: demo-steps-teacher, granularity: topk}
        teacher_routing: palaestra.environments.math.routing:by_kind
    env: {name: math, args: {difficulty: 0, kinds: [arithmetic, worked_steps]}}

Every sample of one math environment has ``env == "math"``, so routing by environment name
cannot tell the kinds apart; the generated task ids can (``"worked_steps-d0-s7-15"``).
"""

from __future__ import annotations

from collections.abc import Sequence

from palaestra.sample import Sample

__all__ = ["by_kind"]


def by_kind(sample: Sample, teachers: Sequence[str]) -> str:
    """The teacher named after the sample's task kind, else one called ``default``."""
    kind = sample.task_id.split("-d", 1)[0]
    if kind in teachers:
        return kind
    if "default" in teachers:
        return "default"
    raise ValueError(
        f"no teacher for math task kind {kind!r} (task {sample.task_id}); teachers: {list(teachers)}"
    )
