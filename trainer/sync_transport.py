"""What every weight-sync transport is given and gives back (trainer/weight_sync.py runs them).

`Engines` is the HTTP side of a sync: every engine's URL, one pooled client, each call retried
(``sync.retries`` attempts, growing back-off), and one step issued to all engines at once (one
thread per engine), returning only when every engine has answered. `Clock` collects the seconds of
each phase and each engine's share of it. `Transport` is the protocol of one ``sync.mode``: how the
weights travel (shm file, disk directory, tensor bytes, CUDA IPC handles, broadcast, LoRA adapter),
while `WeightSync` keeps the pause -> update -> version check -> continue around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

__all__ = ["Clock", "Engines", "Transport", "TransportOptions", "WeightSyncError", "make_buckets"]

log = logging.getLogger("palaestra.trainer.weight_sync")


class WeightSyncError(RuntimeError):
    """An engine did not take the new weights; the message names the engine and the step."""


class Clock:
    """Seconds per phase of one sync (wall time of the step) and per engine within each step."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.engines: dict[str, dict[str, float]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def step(self, name: str, per_engine: dict[str, float]) -> None:
        """Records a step `Engines.each` ran: its wall time is the slowest engine's."""
        self.phases[name] = self.phases.get(name, 0.0) + max(per_engine.values(), default=0.0)
        for url, seconds in per_engine.items():
            self.engines.setdefault(url, {})[name] = seconds


@dataclass(frozen=True)
class TransportOptions:
    """What every transport of `weight_sync.TRANSPORTS` is built from (the trainer's ``sync_*``)."""

    bucket_bytes: int = 512 * 1024 * 1024
    """tensor, ipc, distributed: the most bytes of tensors in one update call (`make_buckets`)."""
    disk_dir: Path | None = None
    """disk: the directory every engine reads (``sync.dir``); shm and the adapter: where their
    files go instead of /dev/shm."""
    group_address: str | None = None
    """distributed: the address the engines reach the trainer's rendezvous at (None: the one
    towards the engines)."""
    group_port: int = 0
    """distributed: the rendezvous port (0: a free one)."""


def make_buckets(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each and of one dtype (a flattened
    bucket is one tensor); a tensor larger than the budget goes alone."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and (size + n > bucket_bytes or t.dtype != current[0][1].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        buckets.append(current)
    return buckets


class Transport(Protocol):
    """One ``sync.mode``: how a payload (HF-named tensors; for the adapter transport a LoRA adapter)
    reaches every engine. `WeightSync` calls, per sync: `stage` before the pause, `send` inside
    it, `done` after the engines continued; `directory` and `close` whenever."""

    def stage(self, payload: Any, version: str, clock: Clock) -> Any:
        """Work done while the engines still generate (timed by the transport, phase "stage");
        returns what `send` needs. Changes no engine's weights."""

    def send(self, staged: Any, version: str, clock: Clock) -> int:
        """Inside the pause: every engine takes the weights and reports `version` as its
        weight_version. Calls `Engines.changing` before it does anything that may change an
        engine's weights. Returns the number of update calls (buckets) per engine."""

    def done(self, staged: Any, version: str, clock: Clock) -> None:
        """After a sync every engine confirmed: drops what older versions left behind."""

    def directory(self, version: str) -> Path | None:
        """A directory holding the weights pushed as `version`, if this transport keeps one."""

    def close(self) -> None:
        """Drops what the transport holds (files, groups); engines keep their weights."""


class Engines:
    """The engines of one sync (`urls`) over one pooled HTTP client; `close()` when done.

    `client`, if given, is used instead of a pooled one (and not closed here): a test transport."""

    def __init__(
        self,
        urls: Sequence[str],
        retries: int = 3,
        timeout_s: float = 300.0,
        client: httpx.Client | None = None,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.retries = max(1, retries)
        self.timeout_s = timeout_s
        self.changed = False  # since `reset_changed`: whether any engine's weights may have changed
        self._client = client
        self._own_client = client is None
        self._threads: ThreadPoolExecutor | None = None  # one thread per engine for each step
        self._version_paths: dict[str, str] = {}  # where each engine answers its weight_version

    @property
    def client(self) -> httpx.Client:
        """The pooled client every push uses (kept alive between syncs: no connection set-up per call)."""
        if self._client is None:
            n = max(2, len(self.urls))
            self._client = httpx.Client(
                timeout=self.timeout_s,
                trust_env=False,
                limits=httpx.Limits(max_connections=2 * n, max_keepalive_connections=2 * n),
            )
        return self._client

    def set_urls(self, urls: Sequence[str]) -> None:
        """The engines from now on (one was lost with its node, or came back at another URL)."""
        self.urls = [u.rstrip("/") for u in urls]
        if self._threads is not None:  # sized for the old list
            self._threads.shutdown()
            self._threads = None

    def close(self) -> None:
        if self._client is not None and self._own_client:
            self._client.close()
            self._client = None
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    # -- weights changing ------------------------------------------------------------------------
    def changing(self) -> None:
        """A transport is about to do something that may change an engine's weights (an update
        call, a write into memory an engine maps): a failure from here on may leave them mixed."""
        self.changed = True

    def reset_changed(self) -> None:
        self.changed = False

    # -- one HTTP call, retried ------------------------------------------------------------------
    def call(
        self,
        url: str,
        step: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        ok: tuple[int, ...] = (200,),
        retries: int | None = None,
        client: httpx.Client | None = None,
    ) -> httpx.Response:
        """`method` `path` on the engine at `url`, retried; a `WeightSyncError` naming the engine
        and `step` once every attempt failed (an answer with ``"success": false`` is a failure)."""
        client = client or self.client
        last = ""
        attempts = retries or self.retries
        for attempt in range(1, attempts + 1):
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
            if attempt < attempts:
                log.warning("engine %s: %s failed (attempt %d/%d): %s", url, step, attempt, attempts, last)
                time.sleep(0.2 * attempt)
        raise WeightSyncError(f"engine {url}: {step} failed after {attempts} attempts: {last}")

    def post_once(self, url: str, step: str, path: str, body: dict) -> Any:
        """One POST, not retried, on its own connection (the broadcast calls run in threads and
        cannot be replayed alone); the parsed answer."""
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            return self.call(url, step, "POST", path, body, retries=1, client=client).json()

    def server_info(self, url: str, client: httpx.Client | None = None) -> dict[str, Any]:
        r = self.call(url, "read server_info", "GET", "/server_info", client=client)
        try:
            info = r.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise WeightSyncError(f"engine {url}: bad /server_info {r.text[:200]!r}")
        return info

    def tp_size(self, url: str) -> int:
        info = self.server_info(url)
        try:
            return int(info.get("tp_size", 1))
        except (ValueError, TypeError) as exc:
            raise WeightSyncError(f"engine {url}: bad tp_size in /server_info {info!r:.200}") from exc

    def read_version(self, url: str, client: httpx.Client | None = None) -> str:
        """The engine's weight_version: /get_weight_version, or /model_info where that is a 404
        (remembered, so later reads are one call)."""
        path = self._version_paths.get(url, "/get_weight_version")
        r = self.call(url, "read weight_version", "GET", path, ok=(200, 404), client=client)
        if r.status_code == 404 and path != "/model_info":  # recent SGLang: only /model_info has it
            path = "/model_info"
            r = self.call(url, "read weight_version", "GET", path, client=client)
        elif r.status_code == 404:
            raise WeightSyncError(f"engine {url}: read weight_version failed: {path} answers 404")
        self._version_paths[url] = path
        try:
            return str(r.json()["weight_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"engine {url}: no weight_version in {r.text[:200]!r}") from exc

    # -- one step on every engine ----------------------------------------------------------------
    def each(self, fn: Callable[[str], Any], urls: Sequence[str] | None = None) -> dict[str, float]:
        """`fn(url)` on every engine (or on `urls`) at once; returns once all have answered (seconds
        per engine). A failure is raised only then, so no engine is left mid-step while the caller
        moves on."""
        urls = list(self.urls if urls is None else urls)

        def timed(url: str) -> tuple[float, BaseException | None]:
            t0 = time.perf_counter()
            try:
                fn(url)
            except Exception as exc:  # re-raised below, after every engine has finished this step
                return time.perf_counter() - t0, exc
            return time.perf_counter() - t0, None

        if len(urls) == 1:  # no thread hand-off for a single engine
            results = [timed(urls[0])]
        else:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(len(self.urls), thread_name_prefix="weight-sync")
            results = list(self._threads.map(timed, urls))
        for _, error in results:
            if error is not None:
                raise error
        return {url: seconds for url, (seconds, _) in zip(urls, results, strict=True)}

    def update_each(self, calls: Sequence[tuple[str, dict[str, Any]]], version: str, clock: Clock) -> int:
        """`calls` (path, body) on every engine (engines at once, each engine's calls in order) as
        the "update" step; the last one of each carries `version` and the cache flush."""
        self.changing()

        def one_engine(url: str) -> None:
            for i, (path, body) in enumerate(calls):
                last = i == len(calls) - 1
                body = {**body, "flush_cache": last}
                if last:
                    body["weight_version"] = version
                self.call(url, f"update {i + 1}/{len(calls)}", "POST", path, body)

        clock.step("update", self.each(one_engine))
        return len(calls)
