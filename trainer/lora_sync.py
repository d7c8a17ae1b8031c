"""Weight sync of LoRA adapters only, through SGLang's LoRA API (docs/engine-protocol.md, "LoRA").

The base model on the engines never changes; each sync sends the adapter, a few MB instead of the
whole model:

0. Staging, while the engines still generate: the adapter is written as a PEFT directory
   (``adapter_config.json`` + ``adapter_model.safetensors``, the base model's checksum in its
   metadata) under ``sync.dir`` (sync.mode disk: a directory every engine reads) or in /dev/shm
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
gateway before every sync, in every run mode), or ``sync.pause_mode: abort``.

`AdapterTransport` is this sync as a weight-sync transport (`WeightSync.push_adapter` runs it);
`swap_adapter` is its step 2, which `WeightSync.load_adapter_directory` runs alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from palaestra.trainer.shm_sync import default_shm_root
from palaestra.trainer.sync_transport import Clock, Engines, TransportOptions, WeightSyncError
from palaestra.weights_format import write_adapter

log = logging.getLogger("palaestra.trainer.weight_sync")

__all__ = ["Adapter", "AdapterStage", "AdapterTransport", "check_lora_support", "swap_adapter"]


def _flags(backend: str, rank: int, targets: list[str]) -> str:
    if backend == "sglang":
        return (
            f"start SGLang with --enable-lora --max-lora-rank {rank} --lora-target-modules "
            f"{' '.join(targets)} (in a palaestra run: engines.sglang.enable_lora: true, "
            f"max_lora_rank: {rank}, lora_target_modules: [{', '.join(targets)}])"
        )
    return "start it with `palaestra engine serve --enable-lora` (in a palaestra run: engines.engine.enable_lora: true)"


def check_lora_support(
    engines: Engines, url: str, rank: int, targets: list[str], client: httpx.Client | None = None
) -> bool:
    """Raises `WeightSyncError` naming the flag to add when the engine at `url` cannot take an
    adapter of `rank` on `targets` (read from its /server_info). Returns whether to stage on it:
    an embedded engine with room for a second adapter (`AdapterTransport`)."""
    info = engines.server_info(url, client=client)
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
    """Where the adapter directories go: ``sync.dir`` or a directory of our own in /dev/shm."""

    def __init__(self, root: str | Path | None):
        if root is not None:
            self.root = Path(root)
            self._cleanup = None
        else:  # named like the shm weights file: an orphan of a killed process is removed the same way
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


def swap_adapter(engines: Engines, name: str, path: Path, version: str, clock: Clock) -> None:
    """Step 2 of the module docstring on every engine at once: `name` serves `path` at `version`."""
    client = engines.client
    engines.changing()

    def one_engine(url: str) -> None:
        r = client.post(url + "/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            message = _error(r)
            if "does not exist" not in message:  # not loaded yet: the first sync, a restarted engine
                raise WeightSyncError(f"engine {url}: unload_lora_adapter {name!r} failed: {message[:300]}")
        answer = engines.call(url, "load_lora_adapter", "POST", "/load_lora_adapter",
                              {"lora_name": name, "lora_path": str(path)}).json()  # fmt: skip
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"engine {url}: load_lora_adapter failed: {answer.get('error_message')}")
        engines.call(url, "update_weight_version", "POST", "/update_weight_version",
                     {"new_version": version, "abort_all_requests": False})  # fmt: skip

    clock.step("update", engines.each(one_engine))


@dataclass(frozen=True)
class Adapter:
    """What an adapter sync sends: the adapter `tensors` (PEFT names, whole) to serve as `name`."""

    name: str
    config: dict[str, Any]  # adapter_config.json
    tensors: dict[str, torch.Tensor]
    base_checksum: str | None = None


@dataclass(frozen=True)
class _Staged:
    name: str
    path: Path  # the version's PEFT directory
    staging: list[str]  # engines that loaded it under its own name (`path.name`) before the pause


class AdapterTransport:
    """LoRA: only the adapter goes to the engines (module docstring). The adapter directories are
    written under ``sync.dir`` if given, else in /dev/shm."""

    def __init__(self, engines: Engines, options: TransportOptions):
        self.engines = engines
        self.root = options.disk_dir
        self.stage_dir: AdapterStage | None = None  # made by the first sync
        self.staging: list[str] = []  # engines that load each version before the pause

    def stage(self, adapter: Adapter, version: str, clock: Clock) -> _Staged:
        engines = self.engines
        with clock.phase("stage"):
            if self.stage_dir is None:
                targets = list(adapter.config["target_modules"])
                rank = int(adapter.config["r"])
                self.staging = [u for u in engines.urls if check_lora_support(engines, u, rank, targets)]
                self.stage_dir = AdapterStage(self.root)
            path = self.stage_dir.write(adapter.name, version, adapter.config, adapter.tensors,
                                        adapter.base_checksum)  # fmt: skip
        staging = [u for u in self.staging if u in engines.urls]
        if staging:
            self._load_staged(staging, path, clock)
        return _Staged(adapter.name, path, staging)

    def _load_staged(self, urls: list[str], path: Path, clock: Clock) -> None:
        """Step 0's load of `path` under its own name on `urls` (a name left by an interrupted sync
        is unloaded first)."""
        client, staged = self.engines.client, path.name

        def one_engine(url: str) -> None:
            body = {"lora_name": staged, "lora_path": str(path)}
            r = client.post(url + "/load_lora_adapter", json=body)
            if r.status_code != 200 and "already exists" in _error(r):
                client.post(url + "/unload_lora_adapter", json={"lora_name": staged})
                r = client.post(url + "/load_lora_adapter", json=body)
            if r.status_code != 200:
                raise WeightSyncError(f"engine {url}: load_lora_adapter {staged!r} failed: {_error(r)[:300]}")

        clock.step("stage_load", self.engines.each(one_engine, urls))

    def send(self, staged: _Staged, version: str, clock: Clock) -> int:
        swap_adapter(self.engines, staged.name, staged.path, version, clock)
        return 1

    def done(self, staged: _Staged, version: str, clock: Clock) -> None:
        """Step 5: the staged name goes (the served name holds the same factors); older versions'
        directories too."""
        client, name = self.engines.client, staged.path.name

        def one_engine(url: str) -> None:
            r = client.post(url + "/unload_lora_adapter", json={"lora_name": name})
            if r.status_code != 200:  # harmless (one more resident name), but said
                log.warning(
                    "engine %s: unloading the staged adapter %r failed: %s", url, name, _error(r)[:300]
                )

        if staged.staging:
            clock.step("unstage", self.engines.each(one_engine, staged.staging))
        assert self.stage_dir is not None
        self.stage_dir.keep_only(staged.path)

    def directory(self, version: str) -> Path | None:
        """The adapter's PEFT directory the engines hold (`WeightSync.load_adapter_directory`)."""
        return self.stage_dir.current if self.stage_dir is not None else None

    def close(self) -> None:
        if self.stage_dir is not None:
            self.stage_dir.close()
            self.stage_dir = None
