"""Weight sync of LoRA adapters only, through SGLang's LoRA API (docs/engine-protocol.md, "LoRA").

The base model on the engines never changes; each sync sends the adapter, a few MB instead of the
whole model:

0. Staging, while the engines still generate: the adapter is written as a PEFT directory
   (``adapter_config.json`` + ``adapter_model.safetensors``, the base model's checksum in its
   metadata) under ``sync_dir`` (sync_mode disk: a directory every engine reads) or in /dev/shm
   (shm: engines on this host), one directory per version (``<name>-v<version>``). On the first
   sync every engine's ``/server_info`` is read: an engine started without LoRA support fails
   the sync with the flag to add. Embedded engines then load the directory under its own name
   (``POST /load_lora_adapter {"lora_name": "<name>-v<version>"}``): they read and check it now,
   and a bad adapter fails the sync before any engine pauses.
1. ``POST /pause_generation`` on every engine.
2. On every engine, ``POST /unload_lora_adapter {"lora_name"}`` (SGLang loads a name once: a new
   version replaces the old one by unload + load; "does not exist" — the first sync, a restarted
   engine — is fine), ``POST /load_lora_adapter {"lora_name", "lora_path"}`` (an embedded engine
   shares the staged adapter's factors: no file is read inside the pause; SGLang reads the files
   here), then ``POST /update_weight_version {"new_version", "abort_all_requests": false}``: the
   engine's weight_version — what every /generate answer reports — is the adapter's version.
3. The version is read back from every engine; 4. ``POST /continue_generation``; 5. the staged
   name is unloaded (the served name keeps the factors).

No cache flush: both engines key cached KV by the adapter's load (SGLang's lora_id, the embedded
engine's uid), so the base model's prefix cache survives every adapter sync.

SGLang's unload waits until no request holding the adapter is in flight, and requests paused in
place hold it: an adapter sync needs generation drained first (`palaestra train` drains the
gateway before every sync, in every run mode), or ``sync_pause_mode: abort``.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

if TYPE_CHECKING:
    from palaestra.trainer.weight_sync import SyncReport, WeightSync

log = logging.getLogger("palaestra.trainer.weight_sync")

__all__ = ["AdapterStage", "check_lora_support", "load_adapter_directory", "push_adapter"]


def _flags(backend: str, rank: int, targets: list[str]) -> str:
    if backend == "sglang":
        return (
            f"start SGLang with --enable-lora --max-lora-rank {rank} --lora-target-modules "
            f"{' '.join(targets)} (in a palaestra run: engines.sglang.enable_lora: true, "
            f"max_lora_rank: {rank}, lora_target_modules: [{', '.join(targets)}])"
        )
    return "start it with `palaestra engine serve --enable-lora` (in a palaestra run: engines.engine.enable_lora: true)"


def check_lora_support(
    client: httpx.Client, sync: WeightSync, url: str, rank: int, targets: list[str]
) -> bool:
    """Raises `WeightSyncError` naming the flag to add when the engine at `url` cannot take an
    adapter of `rank` on `targets` (read from its /server_info). Returns whether to stage on it:
    an embedded engine with room for a second adapter (`push_adapter`)."""
    from palaestra.trainer.weight_sync import WeightSyncError

    info = sync._call(client, url, "read server_info", "GET", "/server_info").json()
    backend = "embedded" if info.get("engine") == "palaestra-embedded" else "sglang"
    if not info.get("enable_lora") and not info.get("lora_paths"):
        raise WeightSyncError(
            f"engine {url} serves without LoRA support, so it cannot take the adapter: {_flags(backend, rank, targets)}"
        )
    max_rank = info.get("max_lora_rank")
    if isinstance(max_rank, int) and max_rank < rank:
        raise WeightSyncError(
            f"engine {url} takes adapters up to rank {max_rank} (--max-lora-rank); trainer.lora.rank is {rank}: "
            f"{_flags(backend, rank, targets)}"
        )
    served = info.get("lora_target_modules")
    if served and "all" not in served:
        missing = sorted(set(targets) - set(served))
        if missing:
            raise WeightSyncError(
                f"engine {url} adapts only {sorted(served)} (--lora-target-modules); the adapter also "
                f"adapts {missing}: {_flags(backend, rank, targets)}"
            )
    room = info.get("max_loaded_loras")
    return backend == "embedded" and (not isinstance(room, int) or room >= 2)


class AdapterStage:
    """Where the adapter directories go: ``sync_dir`` or a directory of our own in /dev/shm."""

    def __init__(self, root: str | Path | None):
        from palaestra.trainer.shm_sync import default_shm_root

        if root is not None:
            self.root = Path(root)
            self._cleanup = None
        else:  # named like the shm weights file: an orphan of a killed process is removed the same way
            import os

            self.root = default_shm_root() / f"palaestra-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.current: Path | None = None

    def write(
        self,
        name: str,
        version: str,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        checksum: str | None,
    ) -> Path:
        from palaestra.engine.lora import write_adapter

        return write_adapter(self.root / f"{name}-v{version}", config, tensors, checksum)

    def keep_only(self, path: Path) -> None:
        """Drops every other version's directory (the engines hold `path` now)."""
        self.current = path
        for old in self.root.glob(f"{path.name.rsplit('-v', 1)[0]}-v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()


def _error(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error_message") or r.text)
    except (ValueError, AttributeError):
        return r.text


def _stage(sync: WeightSync, client: httpx.Client, urls: list[str], staged: str, path: Path, clock) -> None:
    """Step 0's load of `path` as `staged` on `urls` (a name left by an interrupted sync is
    unloaded first)."""
    from palaestra.trainer.weight_sync import WeightSyncError

    def one_engine(url: str) -> None:
        body = {"lora_name": staged, "lora_path": str(path)}
        r = client.post(url + "/load_lora_adapter", json=body)
        if r.status_code != 200 and "already exists" in _error(r):
            client.post(url + "/unload_lora_adapter", json={"lora_name": staged})
            r = client.post(url + "/load_lora_adapter", json=body)
        if r.status_code != 200:
            raise WeightSyncError(f"engine {url}: load_lora_adapter {staged!r} failed: {_error(r)[:300]}")

    clock.step("stage_load", sync._each(one_engine, urls))


def _unstage(sync: WeightSync, client: httpx.Client, urls: list[str], staged: str, clock) -> None:
    """Step 5: the staged name goes; the served name holds the same factors."""

    def one_engine(url: str) -> None:
        r = client.post(url + "/unload_lora_adapter", json={"lora_name": staged})
        if r.status_code != 200:  # harmless (one more resident name), but said
            log.warning("engine %s: unloading the staged adapter %r failed: %s", url, staged, _error(r)[:300])

    clock.step("unstage", sync._each(one_engine, urls))


def _swap(sync: WeightSync, client: httpx.Client, name: str, path: Path, version: str, clock) -> None:
    """Step 2 of the module docstring on every engine at once."""
    from palaestra.trainer.weight_sync import WeightSyncError

    def one_engine(url: str) -> None:
        r = client.post(url + "/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            message = _error(r)
            if "does not exist" not in message:  # not loaded yet: the first sync, a restarted engine
                raise WeightSyncError(f"engine {url}: unload_lora_adapter {name!r} failed: {message[:300]}")
        answer = sync._call(client, url, "load_lora_adapter", "POST", "/load_lora_adapter",
                            {"lora_name": name, "lora_path": str(path)}).json()  # fmt: skip
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"engine {url}: load_lora_adapter failed: {answer.get('error_message')}")
        sync._call(client, url, "update_weight_version", "POST", "/update_weight_version",
                   {"new_version": version, "abort_all_requests": False})  # fmt: skip

    clock.step("update", sync._each(one_engine))


def push_adapter(
    sync: WeightSync,
    name: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    version: int | str,
    checksum: str | None,
) -> SyncReport:
    """Sends the adapter `tensors` (PEFT names, whole) as `name` at `version` (module docstring)."""
    from palaestra.trainer.weight_sync import SyncReport, _Clock

    v = str(version)
    started = time.perf_counter()
    clock = _Clock()
    client = sync.client
    with clock.phase("stage"):
        if sync._adapter_stage is None:
            targets = list(config["target_modules"])
            sync._adapter_staging = [
                url for url in sync.urls if check_lora_support(client, sync, url, int(config["r"]), targets)
            ]
            sync._adapter_stage = AdapterStage(sync.disk_dir)
        path = sync._adapter_stage.write(name, v, config, tensors, checksum)
    staging = [u for u in sync._adapter_staging if u in sync.urls]
    if staging:
        _stage(sync, client, staging, path.name, path, clock)

    def update() -> int:
        _swap(sync, client, name, path, v, clock)
        return 1

    _, pause_s = sync._paused(client, update, v, clock)
    if staging:
        _unstage(sync, client, staging, path.name, clock)
    sync._adapter_stage.keep_only(path)
    sync._adapter_name = name
    return SyncReport(
        version=v,
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        seconds=time.perf_counter() - started,
        buckets=1,
        engines=len(sync.urls),
        pause_seconds=pause_s,
        phases=clock.phases,
        engine_seconds=clock.engines,
    )


def load_adapter_directory(sync: WeightSync, path: str | Path, name: str, version: int | str) -> SyncReport:
    """Every engine serves the PEFT directory `path` as adapter `name` at `version` (an engine
    restarted mid-run gets the adapter the others hold); the same steps as `push_adapter`."""
    from palaestra.trainer.weight_sync import SyncReport, _Clock

    v = str(version)
    started = time.perf_counter()
    clock = _Clock()
    client = sync.client

    def update() -> int:
        _swap(sync, client, name, Path(path), v, clock)
        return 1

    _, pause_s = sync._paused(client, update, v, clock)
    return SyncReport(
        v, 0, time.perf_counter() - started, 1, len(sync.urls), pause_s, clock.phases, clock.engines
    )
