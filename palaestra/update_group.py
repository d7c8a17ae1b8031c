"""The process group of SGLang's broadcast weight update, joined alike by both of its ends.

The trainer (`palaestra.trainer.sglang_sync`, rank 0) and every engine rank (`engine/weight_group.py`
for the embedded engine, SGLang's own code for SGLang) form one group outside any default group.
`new_update_group` builds it the way SGLang does (a TCP-store rendezvous at the master's address, a
prefix store named after the group, torch's process-group helper), so a trainer built against
SGLang and the embedded engine agree on the store keys; `drop_update_group` takes it down.
"""

from __future__ import annotations

import datetime

__all__ = ["DEFAULT_GROUP", "drop_update_group", "new_update_group"]

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
