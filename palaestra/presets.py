"""Temporary: model presets moved to `palaestra.models` (one file per recipe).

Kept only so that palaestra/train.py, palaestra/actors.py and trainer/trainer.py, which another
branch of the restructure edits, keep importing until they say `from palaestra.models import ...`;
delete this file then. Nothing new may import it.
"""

from palaestra.models import PRESETS, resolve_model

__all__ = ["PRESETS", "resolve_model"]
