"""``sync.mode: disk``: one safetensors directory per version under ``sync.dir``, which every engine
reads (a shared filesystem), loaded with ``/update_weights_from_disk``.

The directory is written while the engines still generate (``<sync.dir>/.v<version>.tmp``, renamed
to ``v<version>`` when complete) and the directories of older versions are removed once every engine
holds the new one. The fallback that works with any engine that sees the directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from palaestra.trainer.sync_transport import Clock, Engines, TransportOptions

__all__ = ["DiskTransport"]


class DiskTransport:
    """``sync.mode: disk`` (module docstring)."""

    def __init__(self, engines: Engines, options: TransportOptions):
        if options.disk_dir is None:
            raise ValueError("sync.mode 'disk' needs sync.dir (a directory every engine can read)")
        self.engines = engines
        self.root = Path(options.disk_dir)

    def stage(
        self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock
    ) -> list[tuple[str, dict[str, Any]]]:
        from safetensors.torch import save_file

        with clock.phase("stage"):
            target = self.root / f"v{version}"
            tmp = self.root / f".v{version}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file({n: t.detach().contiguous().cpu() for n, t in named}, str(tmp / "model.safetensors"))
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        return [("/update_weights_from_disk", {"model_path": str(target)})]

    def send(self, calls: list[tuple[str, dict[str, Any]]], version: str, clock: Clock) -> int:
        return self.engines.update_each(calls, version, clock)

    def done(self, staged: object, version: str, clock: Clock) -> None:
        for old in self.root.glob("v*"):  # keep only the version the engines now hold
            if old.name != f"v{version}":
                shutil.rmtree(old, ignore_errors=True)

    def directory(self, version: str) -> Path | None:
        path = self.root / f"v{version}"
        return path if path.is_dir() else None

    def close(self) -> None:
        pass
