"""Pushing new weights (HF names) to every inference engine over the SGLang protocol.

One sync, for all engines together, so that no engine ever generates with a version the others
have left behind:

1. ``POST /pause_generation {"mode": "in_place"}`` on every engine (running requests freeze with
   their KV; new ones wait).
2. The weights, on every engine: ``/update_weights_from_tensor`` in buckets of at most
   ``sync_bucket_mb`` (the payload of `palaestra.engine.weights.serialize_named_tensors`,
   SGLang's ``flattened_bucket`` layout), or ``/update_weights_from_disk`` of a safetensors
   directory written once. Only the last call of an engine carries ``weight_version`` and
   ``flush_cache: true``, so the version changes exactly when every tensor is in.
3. ``/flush_cache`` (a 400 is expected while requests are frozen in place; the last update call
   already flushed the prefix cache), then the version is read back from every engine
   (``/get_weight_version``, or ``/model_info`` where that answers 404).
4. ``POST /continue_generation`` on every engine.

`load_directory` runs the same four steps with an HF directory every engine reads itself (other
weights than the trainer's, e.g. the teacher's for a reference evaluation).

Every call is retried (``sync_retries`` attempts, growing back-off). If an engine still fails,
`WeightSyncError` names it and the step, and the engines are left **paused**: nothing generates
with a mix of versions until the caller decides what to do.

The tensor payload is serialized bytes (what the embedded engine reads); real SGLang expects CUDA
IPC handles there, so with SGLang servers use ``sync_mode="disk"``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from palaestra.engine.weights import serialize_named_tensors

__all__ = ["SyncReport", "WeightSync", "WeightSyncError", "make_buckets"]

log = logging.getLogger("palaestra.trainer.weight_sync")


class WeightSyncError(RuntimeError):
    """An engine did not take the new weights; the message names the engine and the step."""


@dataclass
class SyncReport:
    version: str
    bytes: int  # raw tensor bytes sent to one engine
    seconds: float
    buckets: int
    engines: int


def make_buckets(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a larger tensor goes alone)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        buckets.append(current)
    return buckets


class WeightSync:
    def __init__(
        self,
        urls: Sequence[str],
        mode: Literal["tensor", "disk"] = "tensor",
        bucket_mb: int = 512,
        retries: int = 3,
        timeout_s: float = 300.0,
        disk_dir: str | Path | None = None,
        pause_mode: str = "in_place",
    ):
        if mode not in ("tensor", "disk"):
            raise ValueError(f"sync_mode must be 'tensor' or 'disk', got {mode!r}")
        if mode == "disk" and disk_dir is None:
            raise ValueError("sync_mode 'disk' needs sync_dir (a directory every engine can read)")
        self.urls = [u.rstrip("/") for u in urls]
        self.mode = mode
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.retries = max(1, retries)
        self.timeout_s = timeout_s
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.pause_mode = pause_mode

    # -- one HTTP call, retried ----------------------------------------------------------------
    def _call(
        self, client: httpx.Client, url: str, step: str, method: str, path: str, body: Any = None, ok=(200,)
    ) -> httpx.Response:
        last = ""
        for attempt in range(1, self.retries + 1):
            try:
                r = client.request(method, url + path, json=body)
                if r.status_code in ok:
                    if r.headers.get("content-type", "").startswith("application/json"):
                        payload = r.json()
                        if isinstance(payload, dict) and payload.get("success") is False:
                            raise WeightSyncError(payload.get("message", "success: false"))
                    return r
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except (httpx.HTTPError, WeightSyncError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                log.warning(
                    "engine %s: %s failed (attempt %d/%d): %s", url, step, attempt, self.retries, last
                )
                time.sleep(0.2 * attempt)
        raise WeightSyncError(f"engine {url}: {step} failed after {self.retries} attempts: {last}")

    def read_version(self, client: httpx.Client, url: str) -> str:
        """The engine's weight_version: /get_weight_version, or /model_info where that is a 404."""
        r = self._call(client, url, "read weight_version", "GET", "/get_weight_version", ok=(200, 404))
        if r.status_code == 404:  # recent SGLang: the version lives in /model_info only
            r = self._call(client, url, "read weight_version", "GET", "/model_info")
        try:
            return str(r.json()["weight_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"engine {url}: no weight_version in {r.text[:200]!r}") from exc

    # -- the sync ------------------------------------------------------------------------------
    def _write_disk(self, named: Sequence[tuple[str, torch.Tensor]], version: str) -> Path:
        from safetensors.torch import save_file

        assert self.disk_dir is not None
        target = self.disk_dir / f"v{version}"
        tmp = self.disk_dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({n: t.detach().contiguous().cpu() for n, t in named}, str(tmp / "model.safetensors"))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target

    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: int | str) -> SyncReport:
        """Sends `named` (HF names) to every engine and confirms `version` on each (module docstring)."""
        v = str(version)
        started = time.perf_counter()
        raw = sum(t.numel() * t.element_size() for _, t in named)
        if self.mode == "disk":
            path = self._write_disk(named, v)
            calls = [("/update_weights_from_disk", {"model_path": str(path)})]
        else:
            buckets = make_buckets(named, self.bucket_bytes)
            calls = [
                (
                    "/update_weights_from_tensor",
                    {
                        "serialized_named_tensors": [serialize_named_tensors(b, flattened=True)],
                        "load_format": "flattened_bucket",
                    },
                )
                for b in buckets
            ]
        self._update_all(calls, v)
        if self.mode == "disk":
            for old in self.disk_dir.glob("v*"):  # keep only the version the engines now hold
                if old.name != f"v{v}":
                    shutil.rmtree(old, ignore_errors=True)
        return SyncReport(
            version=v,
            bytes=raw,
            seconds=time.perf_counter() - started,
            buckets=len(calls),
            engines=len(self.urls),
        )

    def load_directory(self, model_dir: str | Path, version: int | str) -> SyncReport:
        """Every engine loads the HF directory `model_dir` (readable by each of them) as `version`:
        other weights than the trainer's, e.g. a teacher's for evaluation. The same pause → update
        → flush → version check → continue as `push`, whatever `mode` is."""
        v = str(version)
        started = time.perf_counter()
        self._update_all([("/update_weights_from_disk", {"model_path": str(model_dir)})], v)
        return SyncReport(
            version=v, bytes=0, seconds=time.perf_counter() - started, buckets=1, engines=len(self.urls)
        )

    def _update_all(self, calls: Sequence[tuple[str, dict[str, Any]]], v: str) -> None:
        """Steps 1-4 of the module docstring: `calls` (path, body) on every engine, ending at `v`."""
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            for url in self.urls:
                self._call(client, url, "pause", "POST", "/pause_generation", {"mode": self.pause_mode})
            for url in self.urls:
                for i, (path_, body) in enumerate(calls):
                    last = i == len(calls) - 1
                    body = {**body, "flush_cache": last}
                    if last:
                        body["weight_version"] = v
                    self._call(client, url, f"update {i + 1}/{len(calls)}", "POST", path_, body)
            for url in self.urls:
                self._call(client, url, "flush_cache", "POST", "/flush_cache", ok=(200, 400))
                got = self.read_version(client, url)
                if got != v:
                    raise WeightSyncError(
                        f"engine {url}: reports weight_version {got!r} after the update to {v!r}"
                    )
            for url in self.urls:
                self._call(client, url, "continue", "POST", "/continue_generation", {})
