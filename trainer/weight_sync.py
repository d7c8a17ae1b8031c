"""Pushing new weights (HF names) to every inference engine over the SGLang protocol.

One sync, for all engines together, so that no engine ever generates with a version the others
have left behind:

0. Staging, while the engines still generate: the disk directory is written or the tensor
   buckets serialized (the shm file is written inside the pause, step 2: an embedded engine's
   parameters *are* that file's pages).
1. ``POST /pause_generation {"mode": "in_place"}`` on every engine (running requests freeze with
   their KV; new ones wait — the gateway keeps accepting and queues meanwhile).
2. The weights, on every engine, by ``sync.mode`` (one `Transport` per mode, `TRANSPORTS`):

   ========== ================================================ =====================================
   mode       engine calls                                     where
   ========== ================================================ =====================================
   shm        ``/update_weights_from_disk`` of one safetensors  engines on the trainer's host
              file in /dev/shm (`shm_sync.ShmTransport`): raw  (embedded engine or SGLang); the
              bytes, dtype kept; the embedded engine maps it   fastest path, and the default
              (``load_format "mmap"``: one copy in all), SGLang
              copies it
   distributed ``/init_weights_update_group`` once, then per     engines on other GPUs/nodes
              bucket ``/update_weights_from_distributed`` while (decoupled placement); NCCL on GPU,
              rank 0 broadcasts (`sglang_sync.DistributedTransport`) gloo on CPU
   ipc        ``/update_weights_from_tensor`` with CUDA IPC     SGLang colocated on the trainer's
              handles per TP rank (`sglang_sync.IpcTransport`)  GPUs
   tensor     ``/update_weights_from_tensor`` with the bytes    the embedded engine over HTTP, any
              in a ``torch.save`` payload per bucket (base64;   host (slow: JSON + base64)
              `sglang_sync.TensorTransport`)
   disk       ``/update_weights_from_disk`` of a directory      any engine that sees ``sync.dir``
              written once per version under ``sync.dir``       (shared filesystem); the fallback
              (`disk_sync.DiskTransport`)
   ========== ================================================ =====================================

   Only the last call of an engine carries ``weight_version`` and ``flush_cache: true``, so the
   version changes exactly when every tensor is in.
3. The version is read back from every engine (``/get_weight_version``, or ``/model_info`` where
   that answers 404; the answer is remembered per engine). No separate ``/flush_cache``: the last
   update call flushed the prefix cache (``flush_cache: true``), and with requests frozen in
   place ``/flush_cache`` could only answer 400 anyway.
4. ``POST /continue_generation`` on every engine.

Each step is issued to all engines at once (one thread per engine over one pooled HTTP client) and
the next step starts only when every engine has answered: every engine is paused before any is
updated, and none continues before every version is confirmed.

`load_directory` runs steps 1-4 with an HF directory every engine reads itself (other weights
than the trainer's, e.g. the teacher's for a reference evaluation).

`SyncReport` has the whole push time, the pause (steps 1-4: the time engines do not generate) and
the seconds of each phase (``phases``: stage, pause, write, update, version, continue, and with
LoRA stage_load and unstage; each the wall time of that step over all engines) with the slowest
engine's share per step (``engine_seconds``).
With LoRA only the adapter is sent (`push_adapter`; the adapter transport, trainer/lora_sync.py):
SGLang's /unload_lora_adapter + /load_lora_adapter of a PEFT directory in the same pause (an
embedded engine has read and checked the directory before it, under a staged name).

Every call is retried (``sync.retries`` attempts, growing back-off) except the broadcast ones,
which cannot be replayed alone (trainer/sync_transport.py). If an engine still fails, or the
transport raises, `WeightSyncError` (or the transport's error) says so. Once the transport may have
changed an engine's weights (`Engines.changing`), or when an engine does not pause, the engines
are left **paused**: nothing generates with a mix of versions, or a version the trainer has left
behind, until the caller decides what to do. Only a transport that fails inside the pause before
touching any engine continues them all (on the weights they all still hold) before its error is
raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from palaestra.trainer.disk_sync import DiskTransport
from palaestra.trainer.lora_sync import Adapter, AdapterTransport, check_lora_support, swap_adapter
from palaestra.trainer.sglang_sync import DistributedTransport, IpcTransport, TensorTransport
from palaestra.trainer.shm_sync import ShmTransport
from palaestra.trainer.sync_transport import (
    Clock,
    Engines,
    Transport,
    TransportOptions,
    WeightSyncError,
    make_buckets,
)

__all__ = ["TRANSPORTS", "SyncReport", "WeightSync", "WeightSyncError", "make_buckets"]

log = logging.getLogger("palaestra.trainer.weight_sync")

TRANSPORTS: dict[str, Callable[[Engines, TransportOptions], Transport]] = {
    "shm": ShmTransport,
    "distributed": DistributedTransport,
    "ipc": IpcTransport,
    "tensor": TensorTransport,
    "disk": DiskTransport,
}
"""``sync.mode`` -> its transport (module docstring's table); LoRA adapters go by `AdapterTransport`."""

SYNC_MODES = tuple(TRANSPORTS)


@dataclass
class SyncReport:
    version: str
    bytes: int  # raw tensor bytes sent to one engine
    seconds: float  # the whole push: staging + pause
    buckets: int
    engines: int
    pause_seconds: float = 0.0  # engines paused: pause -> update -> version check -> continue
    phases: dict[str, float] = field(default_factory=dict)  # step -> wall seconds (module docstring)
    engine_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> step -> seconds


class WeightSync:
    """The trainer's side of weight sync to `urls` (module docstring); `close()` when done.

    `client`, if given, carries every engine call instead of a pooled client (a test transport)."""

    def __init__(
        self,
        urls: Sequence[str],
        mode: Literal["shm", "distributed", "ipc", "tensor", "disk"] = "shm",
        bucket_mb: int = 512,
        retries: int = 3,
        timeout_s: float = 300.0,
        disk_dir: str | Path | None = None,
        pause_mode: str = "in_place",
        group_address: str | None = None,
        group_port: int = 0,
        client: httpx.Client | None = None,
    ):
        if mode not in TRANSPORTS:
            raise ValueError(f"sync.mode must be one of {', '.join(SYNC_MODES)}; got {mode!r}")
        self.mode = mode
        self.pause_mode = pause_mode
        self.engines = Engines(urls, retries, timeout_s, client)
        self.options = TransportOptions(
            bucket_mb * 1024 * 1024,
            Path(disk_dir) if disk_dir is not None else None,
            group_address,
            group_port,
        )
        self.transport = TRANSPORTS[mode](self.engines, self.options)
        self.adapters: AdapterTransport | None = None  # LoRA: made by the first `push_adapter`

    @property
    def urls(self) -> list[str]:
        return self.engines.urls

    def set_engines(self, urls: Sequence[str]) -> None:
        """The engines the next syncs reach: the driver lost one with its node, or brought it back
        at another URL (orchestrator/supervisor.py). Not in mode distributed, whose NCCL group
        holds the engines it was built with."""
        if self.mode == "distributed":
            raise ValueError(
                "sync.mode distributed cannot change its engines (the NCCL group is built once); "
                "use sync.mode shm, disk or tensor to survive the loss of an engine's node"
            )
        self.engines.set_urls(urls)

    def close(self) -> None:
        """Drops the transports' files and groups (engines keep the weights they hold)."""
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None
        self.transport.close()
        self.engines.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def pushed_directory(self, version: int | str) -> Path | None:
        """A safetensors directory holding the weights pushed as `version`, if one exists: the shm
        file (rewritten only inside the next push) or the disk mode's version directory; None in
        the other modes. An engine restarted between syncs loads it (`load_directory`). With LoRA
        the adapter's PEFT directory (`load_adapter_directory`)."""
        if self.adapters is not None:
            return self.adapters.directory(str(version))
        return self.transport.directory(str(version))

    def read_version(self, client: httpx.Client, url: str) -> str:
        """The engine's weight_version (`Engines.read_version`) over `client`."""
        return self.engines.read_version(url, client=client)

    # -- the syncs -------------------------------------------------------------------------------
    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: int | str) -> SyncReport:
        """Sends `named` (HF names) to every engine and confirms `version` on each (module docstring)."""
        raw = sum(t.numel() * t.element_size() for _, t in named)
        return self._sync(self.transport, named, str(version), raw)

    def push_adapter(
        self,
        name: str,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        version: int | str,
        base_checksum: str | None = None,
    ) -> SyncReport:
        """LoRA: sends the adapter `tensors` (PEFT names, whole) as adapter `name` at `version`
        to every engine, nothing else (trainer/lora_sync.py)."""
        if self.adapters is None:
            self.adapters = AdapterTransport(self.engines, self.options)
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        return self._sync(self.adapters, Adapter(name, config, tensors, base_checksum), str(version), raw)

    def check_lora(self, rank: int, targets: list[str]) -> None:
        """Raises `WeightSyncError` with the flag to add for an engine that cannot take an adapter
        of `rank` on `targets` (its /server_info: started without LoRA, a lower max rank, ...)."""
        for url in self.engines.urls:
            check_lora_support(self.engines, url, rank, targets)

    def load_adapter_directory(self, path: str | Path, name: str, version: int | str) -> SyncReport:
        """Every engine serves the PEFT directory `path` as adapter `name` at `version` (an engine
        restarted mid-run gets the adapter the others hold)."""
        v, started, clock = str(version), time.perf_counter(), Clock()

        def update() -> int:
            swap_adapter(self.engines, name, Path(path), v, clock)
            return 1

        _, pause_s = self._paused(update, v, clock)
        return self._report(v, 0, started, 1, pause_s, clock)

    def load_directory(self, model_dir: str | Path, version: int | str) -> SyncReport:
        """Every engine loads the HF directory `model_dir` (readable by each of them) as `version`:
        other weights than the trainer's, e.g. a teacher's for evaluation. The same pause → update
        → version check → continue as `push`, whatever `mode` is."""
        v, started, clock = str(version), time.perf_counter(), Clock()
        calls = [("/update_weights_from_disk", {"model_path": str(model_dir)})]
        _, pause_s = self._paused(lambda: self.engines.update_each(calls, v, clock), v, clock)
        # An engine whose parameters are the shm file's pages copies these weights into that file;
        # the next push rewrites every byte of it, so nothing stale survives.
        return self._report(v, 0, started, 1, pause_s, clock)

    def _sync(self, transport: Transport, payload: Any, v: str, raw: int) -> SyncReport:
        """Stage, pause -> send -> version check -> continue, done (module docstring)."""
        started, clock = time.perf_counter(), Clock()
        staged = transport.stage(payload, v, clock)
        try:
            count, pause_s = self._paused(lambda: transport.send(staged, v, clock), v, clock)
            transport.done(staged, v, clock)
        finally:
            staged = None  # buckets, IPC memory: gone with this sync, also when it failed
        return self._report(v, raw, started, count, pause_s, clock)

    def _report(
        self, v: str, raw: int, started: float, count: int, pause_s: float, clock: Clock
    ) -> SyncReport:
        return SyncReport(
            version=v,
            bytes=raw,
            seconds=time.perf_counter() - started,
            buckets=count,
            engines=len(self.engines.urls),
            pause_seconds=pause_s,
            phases=clock.phases,
            engine_seconds=clock.engines,
        )

    def _paused(self, update: Callable[[], int], v: str, clock: Clock) -> tuple[int, float]:
        """Steps 1-4 of the module docstring around `update`; (its count, seconds paused). An
        `update` that fails before any engine's weights may have changed continues the engines."""
        engines = self.engines
        started = time.perf_counter()
        clock.step("pause", engines.each(lambda url: engines.call(
            url, "pause", "POST", "/pause_generation", {"mode": self.pause_mode})))  # fmt: skip
        engines.reset_changed()
        try:
            count = update()
        except Exception:
            if not engines.changed:  # every engine still holds the weights it had: let them generate
                self._continue()
            raise

        def check(url: str) -> None:
            got = engines.read_version(url)
            if got != v:
                raise WeightSyncError(
                    f"engine {url}: reports weight_version {got!r} after the update to {v!r}"
                )

        clock.step("version", engines.each(check))
        clock.step("continue", engines.each(self._continue_one))
        return count, time.perf_counter() - started

    def _continue_one(self, url: str) -> None:
        self.engines.call(url, "continue", "POST", "/continue_generation", {})

    def _continue(self) -> None:
        """After a transport failed without changing anything: continues every engine, saying (not
        raising) what fails."""
        try:
            self.engines.each(self._continue_one)
        except Exception as exc:  # the sync's own error is the one to raise
            log.warning("continuing the engines after a failed sync: %s", exc)
