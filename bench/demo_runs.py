"""What the end-to-end benchmarks share: one `palaestra train` run of configs/demo.yaml.

Imported by bench/mismatch.py, bench/async_vs_sync.py and bench/opd_vs_grpo.py (run as scripts,
so this directory is on sys.path; the repository root is added here).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from palaestra.config import load_config  # noqa: E402
from palaestra.orchestrator.loop import RunResult  # noqa: E402
from palaestra.train import train  # noqa: E402

CONFIG = ROOT / "configs" / "demo.yaml"


def train_demo(out: Path, name: str, overrides: Sequence[str]) -> RunResult:
    """configs/demo.yaml with `overrides`, written to `out`: only the last step checkpointed, no
    TensorBoard. The per-step metrics (what metrics.jsonl holds) are `result.state.rows`; held-out
    accuracy is in the rows that carry `eval/accuracy` (step 0: before training)."""
    settings = [f"run.output_dir={out}", f"run.name=bench-{name}", "run.checkpoint_every=0",
                "logging.tensorboard_dir=null"]  # fmt: skip
    return train(load_config(CONFIG, [*settings, *overrides]))
