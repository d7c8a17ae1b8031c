"""The model cache: where built models live, and how one is built exactly once.

Every recipe (palaestra/models/tiny.py, smollm2.py, real_vocab.py, environments/math/warmstart.py) writes into
``<cache>/models/<name>-v<VERSION>`` through `build_once`: the build runs in a temporary directory
beside the target, under a file lock, and is renamed into place, so concurrent processes build a
model once and an existing directory is always complete. `write_marker` writes the file whose
presence means "complete" (`MARKER`), last, with what the build was made from.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "MARKER",
    "build_once",
    "cache_root",
    "is_built",
    "model_name",
    "models_dir",
    "preset_dir",
    "write_marker",
]

logger = logging.getLogger(__name__)

MARKER = "palaestra_preset.json"
"""Written last inside a build; its presence means the directory is a complete build."""


def cache_root() -> Path:
    """The cache directory: ``$PALAESTRA_CACHE`` if set, else ``~/.cache/palaestra``."""
    env = os.environ.get("PALAESTRA_CACHE")
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "palaestra"


def models_dir(cache_dir: str | Path | None = None) -> Path:
    """Where built models live: ``<cache_dir>/models`` (``cache_dir`` defaults to `cache_root()`)."""
    root = Path(cache_dir).expanduser().absolute() if cache_dir is not None else cache_root()
    return root / "models"


def preset_dir(name: str, version: int, cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir>/models/<name>-v<version>``: a recipe bumps `version` whenever it changes, so a
    stale build is never reused (old ones are left alone)."""
    return models_dir(cache_dir) / f"{name}-v{version}"


def is_built(directory: Path) -> bool:
    """Whether `directory` is a complete build (its `MARKER` exists)."""
    return (directory / MARKER).is_file()


def model_name(directory: str | Path) -> str:
    """What to call the model in files users carry elsewhere (an adapter's
    ``base_model_name_or_path``): a built preset's name (``tiny``), not its cache path, which means
    nothing on another machine; any other directory as given."""
    try:
        return str(json.loads((Path(directory) / MARKER).read_text())["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(directory)


def write_marker(out_dir: Path, name: str, version: int, **fields: object) -> None:
    """The completion marker: the model's name and recipe version, and `fields` (seed, sources...).

    Call it last inside a `build_once` build function."""
    info = {"name": name, "version": version, **fields}
    (out_dir / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``target`` unless it already exists.

    The lock serialises concurrent builders; whoever waited finds the finished directory.
    Because the rename is atomic, an existing ``target`` is always a complete build.
    """
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building %s; waiting for it", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(target):
            return target
        if target.exists():
            raise RuntimeError(
                f"{target} exists but is not a complete build (no {MARKER}); it was not made by "
                f"Palaestra's atomic build. Remove it and try again."
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.perf_counter()
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target
