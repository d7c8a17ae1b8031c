"""The engine's end of SGLang's broadcast weight update (`/init_weights_update_group` and friends).

    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
                                     group_name="weight_update_group", backend="nccl"}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, load_format=null, ...}
    POST /destroy_weights_update_group {group_name}

The trainer is rank 0 of a process group of its own; every engine rank joins at ``rank_offset``
(the embedded engine has one rank). For each update call the engine receives the listed tensors
in order by broadcast from rank 0, then loads them like any other update. `new_update_group` builds
the group the way SGLang does (TCP-store rendezvous, a prefix store named after the group, torch's
process-group helper), so a trainer built against SGLang and this engine agree on the store keys;
the trainer uses the same function for its side. On CPU the backend is gloo; nccl needs CUDA.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch

from palaestra.engine.protocol import RequestError

__all__ = ["DEFAULT_GROUP", "UpdateGroups", "drop_update_group", "new_update_group"]

DEFAULT_GROUP = "weight_update_group"


def new_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):
    """A process group outside the default one, joined the way SGLang's engines join it.

    Rank 0 hosts the TCP store, on `master_address` only. Collectives on it name their source by group rank
    (``dist.broadcast(t, group=g, group_src=0)``): a process without a default group has no
    global ranks to translate.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper

    from palaestra.rendezvous import tcp_store

    timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0's store listens on `master_address` only (torch's tcp:// rendezvous would take every
    # interface); its keys are those of SGLang's `tcp://` rendezvous, so SGLang engines join it.
    store = tcp_store(master_address, master_port, rank, world_size, timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    return group


def drop_update_group(group) -> None:
    """Shuts a group from `new_update_group` down and forgets it.

    torch's `destroy_process_group` expects a group-rank table that its helper does not fill for a
    group without global ranks; it shuts the group down first and then fails on that table, so the
    remaining bookkeeping is finished here.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        dist.destroy_process_group(group)
    except KeyError:
        world = c10d._world
        for table in (
            world.pg_group_ranks,
            world.pg_backend_config,
            world.pg_coalesce_state,
            world.pg_to_tag,
        ):
            table.pop(group, None)
        c10d._unregister_process_group(group.group_name)


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
