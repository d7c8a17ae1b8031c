"""The engine's end of SGLang's broadcast weight update (`/init_weights_update_group` and friends).

    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
                                     group_name="weight_update_group", backend="nccl"}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, load_format=null, ...}
    POST /destroy_weights_update_group {group_name}

The trainer is rank 0 of a process group of its own; every engine rank joins at ``rank_offset``
(the embedded engine has one rank). For each update call the engine receives the listed tensors
in order by broadcast from rank 0, then loads them like any other update. Both ends join with
`palaestra.update_group.new_update_group`. On CPU the backend is gloo; nccl needs CUDA.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from palaestra.engine.protocol import RequestError
from palaestra.update_group import DEFAULT_GROUP, drop_update_group, new_update_group

__all__ = ["UpdateGroups"]


def _field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RequestError(f"'{name}' must be {kind.__name__}; got {value!r}")
    return value


class UpdateGroups:
    """The weight-update groups this engine has joined, by name (one rank: this process)."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._groups: dict[str, Any] = {}
        self._lock = threading.Lock()

    def init(self, body: dict[str, Any]) -> str:
        """Joins the group described by `body` (blocks until every rank has joined)."""
        address = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        offset = _field(body, "rank_offset", int)
        world = _field(body, "world_size", int)
        name = _field(body, "group_name", str, DEFAULT_GROUP)
        backend = _field(body, "backend", str, "nccl")
        if not 1 <= offset < world:
            raise RequestError(
                f"'rank_offset' must be between 1 and world_size - 1 ({world - 1}); got {offset}"
            )
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError("backend 'nccl' needs CUDA; this engine runs on CPU (use backend 'gloo')")
        with self._lock:
            if name in self._groups:
                raise RequestError(f"weight update group {name!r} exists; destroy it first")
        try:
            group = new_update_group(address, port, offset, world, name, backend, self.timeout_s)
        except Exception as exc:  # rendezvous timeout, unreachable master: a failed call, not a crash
            raise RequestError(f"cannot join weight update group {name!r}: {exc}") from None
        with self._lock:
            self._groups[name] = group
        return f"Joined weight update group {name!r} as rank {offset} of {world} ({backend})."

    def receive(self, body: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """The tensors named in `body`, received in order by broadcast from rank 0."""
        import torch.distributed as dist

        names = _field(body, "names", list)
        dtypes = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        name = _field(body, "group_name", str, DEFAULT_GROUP)
        if not len(names) == len(dtypes) == len(shapes) or not names:
            raise RequestError(
                f"names, dtypes and shapes must be non-empty lists of one length; got "
                f"{len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        if body.get("load_format") not in (None,):
            raise RequestError("load_format must be null for the embedded engine's distributed update")
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise RequestError(f"no weight update group {name!r}; call /init_weights_update_group first")
        tensors = []
        for n, d, s in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, str(d), None)
            if not isinstance(dtype, torch.dtype):
                raise RequestError(f"unknown dtype {d!r} for {n!r}")
            tensors.append((str(n), torch.empty([int(x) for x in s], dtype=dtype)))
        for _, t in tensors:  # the trainer broadcasts them in exactly this order
            dist.broadcast(t, group=group, group_src=0)
        return tensors

    def destroy(self, body: dict[str, Any]) -> str:
        name = _field(body, "group_name", str, DEFAULT_GROUP)
        with self._lock:
            group = self._groups.pop(name, None)
        if group is None:
            raise RequestError(f"no weight update group {name!r}")
        drop_update_group(group)
        return f"Destroyed weight update group {name!r}."
