"""The Megatron trainer: `Sample`s in, better weights out, pushed back to the engines.

Owns the megatron-core model and HF ⇄ Megatron conversion (`convert`, `megatron_model`,
`packed_attention`, `cpu_shim`), packing and the DP schedule (`packing`), advantages and losses
(`estimators`: the table of estimators; `advantages`, `losses`, `objective`), weight snapshots
(`snapshots`), on-policy distillation (`opd_step`, `opd_panel`, `opd_kl`, `opd_teachers`), weight
sync (`weight_sync`) and checkpoints (`checkpoint`). `Trainer` (in `trainer`) ties them together;
see docs/trainer.md. Must not speak HTTP to environments (only to inference engines).

    from palaestra.trainer import Trainer, TrainerConfig
    from palaestra.trainer.config import OpdOptions
    opd = OpdOptions(kl_coef=0.5, teacher_mode="sglang", teacher_urls=[...])
    trainer = Trainer(TrainerConfig(opd=opd), "tiny", engine_urls=["http://127.0.0.1:30001"])
    metrics = trainer.step(samples)

Importing this package is cheap; megatron-core is imported when a `Trainer` is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from palaestra.trainer.trainer import Trainer, format_metrics

__all__ = ["Trainer", "TrainerConfig", "format_metrics"]


def __getattr__(name: str):
    if name in ("Trainer", "format_metrics"):
        from palaestra.trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
