"""SGLang's non-disk weight-update paths, trainer side: a broadcast group, CUDA IPC handles, bytes.

**Distributed** (``sync.mode: distributed``; decoupled placement, engines on other GPUs or nodes).
The trainer's global rank 0 and every engine rank form one process group of their own:

1. ``POST /init_weights_update_group`` to every engine at once — ``master_address``,
   ``master_port``, ``rank_offset`` (1 + the ranks of the engines before it), ``world_size``
   (1 + every engine's ``tp_size``, read from ``/server_info``), ``group_name``, ``backend`` —
   while the trainer joins as rank 0 of the same rendezvous. Done once, on the first sync.
2. Per bucket, ``POST /update_weights_from_distributed`` {``names``, ``dtypes``, ``shapes``,
   ``group_name``} to every engine, and meanwhile the trainer broadcasts each tensor of the bucket
   in that order from rank 0. The engines answer once they have received every tensor.
3. ``POST /destroy_weights_update_group`` on `close`.

The group is built the way SGLang builds its side (`palaestra.update_group.new_update_group`:
a TCP-store rendezvous at ``tcp://master_address:master_port``, a prefix store named after the
group, then torch's process group helper), so both ends agree on the store keys. ``backend`` is ``nccl`` on GPUs and ``gloo``
on CPU (the embedded engine implements the same endpoints with gloo). The master port is the one
inter-node port this path opens (on the trainer's rank-0 host).

**IPC** (``sync.mode: ipc``; colocated placement, trainer and engine on the same GPUs).
``POST /update_weights_from_tensor`` whose ``serialized_named_tensors`` holds, per engine TP rank,
the base64 of a torch-multiprocessing pickle of ``[(name, tensor), ...]`` (or of a
``flattened_bucket`` dict). For CUDA tensors that pickle is a CUDA IPC handle: the engine maps the
trainer's memory, nothing is copied through the host. The tensors must stay alive until the engine
answers, which `WeightSync.push` guarantees by holding them for the call. Every TP rank's entry
is the same full tensors here (SGLang's loader shards them), which is right for one engine GPU per
trainer GPU; with a multi-GPU engine each entry should come from the trainer rank on that GPU.

**Tensor** (``sync.mode: tensor``; the embedded engine over HTTP, any host). The same call with the
bytes themselves, a ``torch.save`` payload per bucket in base64 (`weights_format.serialize_named_tensors`):
slow (JSON + base64), but it needs nothing shared.

`DistributedTransport`, `IpcTransport` and `TensorTransport` are these three as weight-sync
transports (trainer/weight_sync.py).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from palaestra.trainer.sync_transport import Clock, Engines, TransportOptions, WeightSyncError, make_buckets
from palaestra.update_group import DEFAULT_GROUP, drop_update_group, new_update_group
from palaestra.weights_format import flattened_bucket, serialize_named_tensors

__all__ = ["DistributedTransport", "DistributedUpdate", "IpcTransport", "TensorTransport", "ipc_payload"]

log = logging.getLogger("palaestra.trainer.sglang_sync")


def ipc_payload(
    named: Sequence[tuple[str, torch.Tensor]], tp_size: int = 1, flattened: bool = False
) -> tuple[list[str], Any]:
    """``serialized_named_tensors`` for ``/update_weights_from_tensor`` (one entry per engine TP
    rank), and the object the handles point into: keep it alive until the engine has answered,
    or the memory behind the handles is freed under it.

    A torch-multiprocessing pickle (`ForkingPickler`): CUDA tensors become IPC handles, CPU tensors
    shared-memory handles. ``flattened`` packs the tensors (one dtype) into SGLang's
    ``flattened_bucket`` dict.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    if flattened:
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
        obj: Any = flattened_bucket(named)
    else:
        obj = [(name, t.detach().contiguous()) for name, t in named]
    blob = base64.b64encode(ForkingPickler.dumps(obj)).decode("ascii")
    return [blob] * tp_size, obj


class DistributedUpdate:
    """The trainer's end of ``update_weights_from_distributed`` (module docstring).

    `call(url, step, path, body) -> dict` is the caller's HTTP POST (`Engines.post_once`),
    answering the parsed JSON body.
    """

    def __init__(
        self,
        urls: Sequence[str],
        master_address: str,
        master_port: int,
        backend: str | None = None,
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = 300.0,
    ):
        self.urls = list(urls)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group = None
        self.world_size = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="wsync")

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def connect(self, tp_sizes: Sequence[int], call: Callable[[str, str, str, dict], Any]) -> None:
        """Every engine and this process join the group (engine i's ranks follow engine i-1's)."""
        if self.group is not None:
            return
        self.world_size = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        futures = [
            self._pool.submit(
                call,
                url,
                "init_weights_update_group",
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": offset,
                    "world_size": self.world_size,
                    "group_name": self.group_name,
                    "backend": self.backend,
                },
            )
            for url, offset in zip(self.urls, offsets, strict=True)
        ]
        try:
            self.group = new_update_group(
                self.master_address,
                self.master_port,
                0,
                self.world_size,
                self.group_name,
                self.backend,
                self.timeout_s,
            )
        finally:
            for f in futures:
                f.result()  # raises the engine's error, if any, after the rendezvous ended
        log.info(
            "weight update group %r: %d ranks at %s:%d (%s)",
            self.group_name,
            self.world_size,
            self.master_address,
            self.master_port,
            self.backend,
        )

    def send(
        self,
        buckets: Sequence[Sequence[tuple[str, torch.Tensor]]],
        version: str,
        call: Callable[[str, str, str, dict], Any],
    ) -> None:
        """Broadcasts every bucket; the last request of each engine carries `version` and the flush."""
        import torch.distributed as dist

        assert self.group is not None, "connect() first"
        device = self._device()
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body: dict[str, Any] = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "flush_cache": last,
            }
            if last:
                body["weight_version"] = version
            step = f"update_weights_from_distributed {i + 1}/{len(buckets)}"
            futures = [
                self._pool.submit(call, url, step, "/update_weights_from_distributed", body)
                for url in self.urls
            ]
            try:
                for _, t in bucket:
                    dist.broadcast(t.detach().to(device).contiguous(), group=self.group, group_src=0)
            finally:
                for f in futures:
                    f.result()

    def close(self, call: Callable[[str, str, str, dict], Any] | None = None) -> None:
        if self.group is None:
            return
        if call is not None:
            for url in self.urls:
                try:
                    call(url, "destroy_weights_update_group", "/destroy_weights_update_group",
                         {"group_name": self.group_name})  # fmt: skip
                except Exception as exc:  # the engine may be gone already; the group is ours to drop
                    log.warning("engine %s: destroy_weights_update_group failed: %s", url, exc)
        drop_update_group(self.group)
        self.group = None
        self._pool.shutdown(wait=False)


_FLATTENED = "flattened_bucket"


class TensorTransport:
    """``sync.mode: tensor`` (module docstring): buckets serialized before the pause, one
    ``/update_weights_from_tensor`` per bucket inside it."""

    def __init__(self, engines: Engines, options: TransportOptions):
        self.engines = engines
        self.bucket_bytes = options.bucket_bytes

    def stage(
        self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock
    ) -> list[tuple[str, dict[str, Any]]]:
        with clock.phase("stage"):
            return [
                (
                    "/update_weights_from_tensor",
                    {
                        "serialized_named_tensors": [serialize_named_tensors(b, flattened=True)],
                        "load_format": _FLATTENED,
                    },
                )
                for b in make_buckets(named, self.bucket_bytes)
            ]

    def send(self, calls: list[tuple[str, dict[str, Any]]], version: str, clock: Clock) -> int:
        return self.engines.update_each(calls, version, clock)

    def done(self, staged: object, version: str, clock: Clock) -> None:
        pass

    def directory(self, version: str) -> Path | None:
        return None

    def close(self) -> None:
        pass


class IpcTransport(TensorTransport):
    """``sync.mode: ipc`` (module docstring): the same calls as `TensorTransport`, carrying CUDA IPC
    handles to the trainer's memory, which the staged `IpcCalls` hold until `send` has returned."""

    def stage(self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock) -> IpcCalls:
        import torch.multiprocessing as tmp

        with clock.phase("stage"):
            if torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            elif tmp.get_sharing_strategy() == "file_system":
                device = torch.device("cpu")  # shared-memory files stand in for CUDA IPC handles
            else:
                raise WeightSyncError(
                    "sync.mode 'ipc' hands CUDA IPC handles to a colocated SGLang; without CUDA use 'shm' "
                    "(CPU tensors can only be shared across processes with "
                    "torch.multiprocessing.set_sharing_strategy('file_system'))"
                )
            tp = self.engines.tp_size(self.engines.urls[0])
            staged = IpcCalls()
            for b in make_buckets(named, self.bucket_bytes):
                entries, shared = ipc_payload([(n, t.to(device)) for n, t in b], tp_size=tp, flattened=True)
                body = {"serialized_named_tensors": entries, "load_format": _FLATTENED}
                staged.calls.append(("/update_weights_from_tensor", body))
                staged.memory.append(shared)
            return staged

    def send(self, staged: IpcCalls, version: str, clock: Clock) -> int:  # type: ignore[override]
        return self.engines.update_each(staged.calls, version, clock)


@dataclass
class IpcCalls:
    """The update calls of an IPC sync and the memory their handles point into (alive while held)."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    memory: list[Any] = field(default_factory=list)


class DistributedTransport:
    """``sync.mode: distributed`` (module docstring): the group is joined on the first sync (before
    the pause); inside it every bucket is broadcast."""

    def __init__(self, engines: Engines, options: TransportOptions):
        from palaestra.net import address_towards, free_port

        self.engines = engines
        self.bucket_bytes = options.bucket_bytes
        address = options.group_address or address_towards(engines.urls)
        self.group = DistributedUpdate(
            engines.urls, address, options.group_port or free_port(address), timeout_s=engines.timeout_s
        )

    def stage(
        self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock
    ) -> list[list[tuple[str, torch.Tensor]]]:
        with clock.phase("stage"):
            buckets = make_buckets(named, self.bucket_bytes)
            self.group.connect([self.engines.tp_size(u) for u in self.engines.urls], self.engines.post_once)
            return buckets

    def send(self, buckets: list[list[tuple[str, torch.Tensor]]], version: str, clock: Clock) -> int:
        with clock.phase("update"):
            self.engines.changing()
            self.group.send(buckets, version, self.engines.post_once)
        return len(buckets)

    def done(self, staged: object, version: str, clock: Clock) -> None:
        pass

    def directory(self, version: str) -> Path | None:
        return None

    def close(self) -> None:
        self.group.close(self.engines.post_once)
