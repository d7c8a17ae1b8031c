"""Pushing new weights (HF names) to every inference engine over the SGLang protocol.

One sync, for all engines together, so that no engine ever generates with a version the others
have left behind:

0. Staging, while the engines still generate: the disk directory is written or the tensor
   buckets serialized (the shm file is written inside the pause, step 2: an embedded engine's
   parameters *are* that file's pages).
1. ``POST /pause_generation {"mode": "in_place"}`` on every engine (running requests freeze with
   their KV; new ones wait — the gateway keeps accepting and queues meanwhile).
2. The weights, on every engine, by ``sync_mode``:

   ========== ================================================ =====================================
   mode       engine calls                                     where
   ========== ================================================ =====================================
   shm        ``/update_weights_from_disk`` of one safetensors  engines on the trainer's host
              file in /dev/shm (`shm_sync`): raw bytes, dtype  (embedded engine or SGLang); the
              kept; the embedded engine maps it (``load_format  fastest path, and the default
              "mmap"``: one copy in all), SGLang copies it
   distributed ``/init_weights_update_group`` once, then per     engines on other GPUs/nodes
              bucket ``/update_weights_from_distributed`` while (decoupled placement); NCCL on GPU,
              rank 0 broadcasts (`sglang_sync`)                 gloo on CPU
   ipc        ``/update_weights_from_tensor`` with CUDA IPC     SGLang colocated on the trainer's
              handles per TP rank (`sglang_sync.ipc_payload`)   GPUs
   tensor     ``/update_weights_from_tensor`` with the bytes    the embedded engine over HTTP, any
              in a ``torch.save`` payload per bucket (base64)   host (slow: JSON + base64)
   disk       ``/update_weights_from_disk`` of a directory      any engine that sees ``sync_dir``
              written once per version under ``sync_dir``       (shared filesystem); the fallback
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
With LoRA only the adapter is sent (`push_adapter`; trainer/lora_sync.py): SGLang's
/unload_lora_adapter + /load_lora_adapter of a PEFT directory in the same pause (an embedded
engine has read and checked the directory before it, under a staged name).

Every call is retried (``sync_retries`` attempts, growing back-off) except the broadcast ones,
which cannot be replayed alone. If an engine still fails, `WeightSyncError` names it and the step,
and the engines are left **paused**: nothing generates with a mix of versions until the caller
decides what to do.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from palaestra.engine.weights import serialize_named_tensors
from palaestra.net import is_this_host
from palaestra.trainer.shm_sync import SharedWeightsFile

__all__ = ["SyncReport", "WeightSync", "WeightSyncError", "make_buckets"]

log = logging.getLogger("palaestra.trainer.weight_sync")


class WeightSyncError(RuntimeError):
    """An engine did not take the new weights; the message names the engine and the step."""


SYNC_MODES = ("shm", "distributed", "ipc", "tensor", "disk")


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


class WeightSync:
    """The trainer's side of weight sync to `urls` (module docstring); `close()` when done."""

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
    ):
        if mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {', '.join(SYNC_MODES)}; got {mode!r}")
        if mode == "disk" and disk_dir is None:
            raise ValueError("sync_mode 'disk' needs sync_dir (a directory every engine can read)")
        self.urls = [u.rstrip("/") for u in urls]
        self.mode = mode
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.retries = max(1, retries)
        self.timeout_s = timeout_s
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.pause_mode = pause_mode
        self._shm: SharedWeightsFile | None = None
        self._shm_root: str | Path | None = None
        self._group = None
        self._buckets: list[list[tuple[str, torch.Tensor]]] = []  # distributed: staged for the pause
        self._keepalive: list[Any] = []  # ipc: the memory the handles of this push point into
        self._formats: dict[str, str] = {}  # shm: load_format per engine URL
        self._version_paths: dict[str, str] = {}  # where each engine answers its weight_version
        self._adapter_stage = None  # LoRA: where adapter directories are written (lora_sync.AdapterStage)
        self._adapter_name: str | None = None
        self._adapter_staging: list[str] = []  # LoRA: engines that load each version before the pause
        self._client: httpx.Client | None = None  # one connection pool for every push
        self._threads: ThreadPoolExecutor | None = None  # one thread per engine for each step
        if mode == "shm":  # in shared memory on this host; `disk_dir` moves it (e.g. for tests)
            elsewhere = [u for u in self.urls if not is_this_host(u)]
            if elsewhere:
                raise ValueError(
                    f"sync_mode 'shm' needs every engine on this host (its /dev/shm); {elsewhere[0]} is "
                    "not: use sync_mode 'distributed' for engines on other nodes"
                )
            self._shm_root = disk_dir  # the file is made by the first push (reading versions needs none)
        elif mode == "distributed":
            from palaestra.net import address_towards, free_port
            from palaestra.trainer.sglang_sync import DistributedUpdate

            address = group_address or address_towards(self.urls)
            self._group = DistributedUpdate(
                self.urls, address, group_port or free_port(address), timeout_s=timeout_s
            )

    def close(self) -> None:
        """Drops the shm file / the update group (engines keep the weights they hold)."""
        if self._adapter_stage is not None:
            self._adapter_stage.close()
            self._adapter_stage = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._group is not None:
            self._group.close(self._post_once)
            self._group = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    def __enter__(self) -> WeightSync:
        return self

    def pushed_directory(self, version: int | str) -> Path | None:
        """A safetensors directory holding the weights pushed as `version`, if one exists: the shm
        file (rewritten only inside the next push) or the disk mode's version directory; None in
        the other modes. An engine restarted between syncs loads it (`load_directory`). With LoRA
        the adapter's PEFT directory (`load_adapter_directory`)."""
        if self._adapter_stage is not None:
            return self._adapter_stage.current
        if self.mode == "shm" and self._shm is not None and self._shm.path is not None:
            return self._shm.path.parent
        if self.mode == "disk" and self.disk_dir is not None and (self.disk_dir / f"v{version}").is_dir():
            return self.disk_dir / f"v{version}"
        return None

    def __exit__(self, *_: object) -> None:
        self.close()

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

    # -- one HTTP call, retried ----------------------------------------------------------------
    def _call(
        self,
        client: httpx.Client,
        url: str,
        step: str,
        method: str,
        path: str,
        body: Any = None,
        ok=(200,),
        retries: int | None = None,
    ) -> httpx.Response:
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

    def _post_once(self, url: str, step: str, path: str, body: dict) -> Any:
        """One POST, not retried, on its own connection (the group calls run in threads)."""
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            return self._call(client, url, step, "POST", path, body, retries=1).json()

    def read_version(self, client: httpx.Client, url: str) -> str:
        """The engine's weight_version: /get_weight_version, or /model_info where that is a 404
        (remembered, so later reads are one call)."""
        path = self._version_paths.get(url, "/get_weight_version")
        r = self._call(client, url, "read weight_version", "GET", path, ok=(200, 404))
        if r.status_code == 404 and path != "/model_info":  # recent SGLang: only /model_info has it
            path = "/model_info"
            r = self._call(client, url, "read weight_version", "GET", path)
        elif r.status_code == 404:
            raise WeightSyncError(f"engine {url}: read weight_version failed: {path} answers 404")
        self._version_paths[url] = path
        try:
            return str(r.json()["weight_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"engine {url}: no weight_version in {r.text[:200]!r}") from exc

    def _shm_format(self, client: httpx.Client, url: str) -> str:
        """ "mmap" for the embedded engine (it shares the file's pages: no copy), else "safetensors"."""
        if url not in self._formats:
            r = self._call(client, url, "read server_info", "GET", "/server_info")
            embedded = isinstance(r.json(), dict) and r.json().get("engine") == "palaestra-embedded"
            self._formats[url] = "mmap" if embedded else "safetensors"
        return self._formats[url]

    def _tp_size(self, client: httpx.Client, url: str) -> int:
        r = self._call(client, url, "read tp_size", "GET", "/server_info")
        try:
            return int(r.json().get("tp_size", 1))
        except (ValueError, TypeError, AttributeError) as exc:
            raise WeightSyncError(f"engine {url}: bad /server_info {r.text[:200]!r}") from exc

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

    def _stage(
        self, client: httpx.Client, named: Sequence[tuple[str, torch.Tensor]], version: str
    ) -> list[tuple[str, dict[str, Any]]]:
        """Work done before the pause; returns each engine's update calls (none for distributed)."""
        if self.mode == "shm":  # written inside the pause (push): engines may share the file's pages
            return []
        if self.mode == "disk":
            path = self._write_disk(named, version)
            return [("/update_weights_from_disk", {"model_path": str(path)})]
        buckets = make_buckets(named, self.bucket_bytes)
        if self.mode == "distributed":
            assert self._group is not None
            self._group.connect([self._tp_size(client, u) for u in self.urls], self._post_once)
            self._buckets = buckets
            return []
        if self.mode == "ipc":
            import torch.multiprocessing as tmp

            from palaestra.trainer.sglang_sync import ipc_payload

            if torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            elif tmp.get_sharing_strategy() == "file_system":
                device = torch.device("cpu")  # shared-memory files stand in for CUDA IPC handles
            else:
                raise WeightSyncError(
                    "sync_mode 'ipc' hands CUDA IPC handles to a colocated SGLang; without CUDA use 'shm' "
                    "(CPU tensors can only be shared across processes with "
                    "torch.multiprocessing.set_sharing_strategy('file_system'))"
                )
            tp = self._tp_size(client, self.urls[0])
            calls = []
            for b in buckets:
                entries, shared = ipc_payload([(n, t.to(device)) for n, t in b], tp_size=tp, flattened=True)
                self._keepalive.append(shared)  # the handles point into it until push() returns
                calls.append(
                    (
                        "/update_weights_from_tensor",
                        {"serialized_named_tensors": entries, "load_format": "flattened_bucket"},
                    )
                )
            return calls
        return [
            (
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [serialize_named_tensors(b, flattened=True)],
                    "load_format": "flattened_bucket",
                },
            )
            for b in buckets
        ]

    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: int | str) -> SyncReport:
        """Sends `named` (HF names) to every engine and confirms `version` on each (module docstring)."""
        v = str(version)
        started = time.perf_counter()
        raw = sum(t.numel() * t.element_size() for _, t in named)
        clock = _Clock()
        client = self.client
        with clock.phase("stage"):
            calls = self._stage(client, named, v)

        def update() -> int:
            if self.mode == "shm":  # inside the pause: an embedded engine's weights are this file
                with clock.phase("write"):
                    if self._shm is None:
                        self._shm = SharedWeightsFile(self._shm_root)
                    directory = str(self._shm.write(named))
                body = {"model_path": directory, "flush_cache": True, "weight_version": v}
                clock.step("update", self._each(lambda url: self._call(
                    client, url, "update 1/1", "POST", "/update_weights_from_disk",
                    {**body, "load_format": self._shm_format(client, url)})))  # fmt: skip
                return 1
            if self.mode == "distributed":
                assert self._group is not None
                with clock.phase("update"):
                    self._group.send(self._buckets, v, self._post_once)
                return len(self._buckets)
            return self._call_each(client, calls, v, clock)

        try:
            count, pause_s = self._paused(client, update, v, clock)
        finally:
            self._buckets, self._keepalive = [], []
        if self.mode == "disk":
            for old in self.disk_dir.glob("v*"):  # keep only the version the engines now hold
                if old.name != f"v{v}":
                    shutil.rmtree(old, ignore_errors=True)
        return SyncReport(
            version=v,
            bytes=raw,
            seconds=time.perf_counter() - started,
            buckets=count,
            engines=len(self.urls),
            pause_seconds=pause_s,
            phases=clock.phases,
            engine_seconds=clock.engines,
        )

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
        from palaestra.trainer.lora_sync import push_adapter

        return push_adapter(self, name, config, tensors, version, base_checksum)

    def check_lora(self, rank: int, targets: list[str]) -> None:
        """Raises `WeightSyncError` with the flag to add for an engine that cannot take an adapter
        of `rank` on `targets` (its /server_info: started without LoRA, a lower max rank, ...)."""
        from palaestra.trainer.lora_sync import check_lora_support

        for url in self.urls:
            check_lora_support(self.client, self, url, rank, targets)

    def load_adapter_directory(self, path: str | Path, name: str, version: int | str) -> SyncReport:
        """Every engine serves the PEFT directory `path` as adapter `name` at `version`."""
        from palaestra.trainer.lora_sync import load_adapter_directory

        return load_adapter_directory(self, path, name, version)

    def load_directory(self, model_dir: str | Path, version: int | str) -> SyncReport:
        """Every engine loads the HF directory `model_dir` (readable by each of them) as `version`:
        other weights than the trainer's, e.g. a teacher's for evaluation. The same pause → update
        → version check → continue as `push`, whatever `mode` is."""
        v = str(version)
        started = time.perf_counter()
        calls = [("/update_weights_from_disk", {"model_path": str(model_dir)})]
        clock = _Clock()
        client = self.client
        _, pause_s = self._paused(client, lambda: self._call_each(client, calls, v, clock), v, clock)
        # An engine whose parameters are the shm file's pages copies these weights into that file;
        # the next push rewrites every byte of it, so nothing stale survives.
        return SyncReport(
            version=v,
            bytes=0,
            seconds=time.perf_counter() - started,
            buckets=1,
            engines=len(self.urls),
            pause_seconds=pause_s,
            phases=clock.phases,
            engine_seconds=clock.engines,
        )

    def _each(self, fn: Callable[[str], Any], urls: Sequence[str] | None = None) -> dict[str, float]:
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

    def _call_each(
        self, client: httpx.Client, calls: Sequence[tuple[str, dict[str, Any]]], v: str, clock: _Clock
    ) -> int:
        """`calls` on every engine (engines at once, each engine's calls in order); the last one of
        each carries the version and the cache flush."""

        def one_engine(url: str) -> None:
            for i, (path_, body) in enumerate(calls):
                last = i == len(calls) - 1
                body = {**body, "flush_cache": last}
                if last:
                    body["weight_version"] = v
                self._call(client, url, f"update {i + 1}/{len(calls)}", "POST", path_, body)

        clock.step("update", self._each(one_engine))
        return len(calls)

    def _paused(
        self, client: httpx.Client, update: Callable[[], int], v: str, clock: _Clock
    ) -> tuple[int, float]:
        """Steps 1-4 of the module docstring around `update`; (its count, seconds paused)."""
        paused = time.perf_counter()
        clock.step("pause", self._each(lambda url: self._call(
            client, url, "pause", "POST", "/pause_generation", {"mode": self.pause_mode})))  # fmt: skip
        count = update()

        def check(url: str) -> None:
            got = self.read_version(client, url)
            if got != v:
                raise WeightSyncError(
                    f"engine {url}: reports weight_version {got!r} after the update to {v!r}"
                )

        clock.step("version", self._each(check))
        clock.step("continue", self._each(lambda url: self._call(
            client, url, "continue", "POST", "/continue_generation", {})))  # fmt: skip
        return count, time.perf_counter() - paused


class _Clock:
    """Seconds per phase of one sync (wall time of the step) and per engine within each step."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.engines: dict[str, dict[str, float]] = {}
        self._started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def step(self, name: str, per_engine: dict[str, float]) -> None:
        """Records a step `_each` ran: its wall time is the slowest engine's."""
        self.phases[name] = self.phases.get(name, 0.0) + max(per_engine.values(), default=0.0)
        for url, seconds in per_engine.items():
            self.engines.setdefault(url, {})[name] = seconds
