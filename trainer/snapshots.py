"""Tagged copies of the model's weights in three tiers: live (the model), host memory, disk.

One model lives on the device; the other policies a step needs — `ref` for the KL, `old_actor`
for one-step-off-policy training, one `teacher/<name>` per OPD teacher — are weight sets swapped
into it. A tag is in one or more of three tiers:

* live: it is the model's parameters now (exactly one tag, `live`);
* host: a *slot* in CPU memory (`snapshot_tiers.Layout`; pinned with CUDA, so copies are DMA);
* disk: a safetensors spill file, memory-mapped when it is read back.

Without `host_budget_bytes` every tag stays in host memory (the disk tier is unused). With a
budget, at most ``budget // nbytes`` slots exist; when one more is needed a tag leaves host memory
(written to disk first unless its spill file is still current) and comes back on demand. The
victim is, first, one that costs no write (its spill file is current); among
those, or among the rest, the one whose next use is farthest away in the step's *plan*
(`plan(["teacher/a", "teacher/b", "actor"])`, what the trainer knows it will switch to, in order;
a tag not in the plan is used "never"); then the least recently used — Belady's rule where the
order is known, LRU where it is not, without trading one read for a write and a read.

Prefetch: after each switch (and after `plan`), a background thread brings the next planned tag
that is only on disk into a free or evictable slot — evicting only a tag needed later than it —
while the caller computes with the live model. With CUDA it then also copies the slot to a device
staging buffer on a side stream, so the switch itself is a device-to-device copy.
`stats()` reports bytes per tier, switch time, and how much of the disk load time prefetch hid.

* `switch(tag)` makes `tag` live. The outgoing live tag is first stored in a slot if it has no
  valid copy (after an optimizer step — `mark_live_changed()` — it has none).
* `save(tag)`, `load(tag, tensors)`, `copy(src, dst)` fill a tag without changing the live model.
* With only one tag (a run without ref, teacher or old actor) the store holds no copy at all: it
  keeps a cheap fingerprint of the live weights and `switch` verifies it, so a caller that swapped
  weights behind the store's back is caught instead of silently training on them.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from palaestra.trainer.snapshot_tiers import DeviceStaging, Layout, read_spill, spill_path, write_spill

__all__ = ["SnapshotStore"]

_COUNTERS = ("switches", "switch_s", "live_to_host_b", "host_to_live_b", "host_to_disk_b", "disk_to_host_b",
             "load_s", "prefetch_load_s", "prefetch_wait_s", "prefetches", "demand_loads")  # fmt: skip


@dataclass
class _Entry:
    slot: int | None = None  # host slot holding a valid copy
    on_disk: bool = False  # the spill file holds a valid copy
    last_used: int = 0
    loading: Future | None = None  # a prefetch in flight


class SnapshotStore:
    def __init__(
        self,
        model: torch.nn.Module,
        live_tag: str = "actor",
        host_budget_bytes: int | None = None,
        spill_dir: str | Path | None = None,
        prefetch: bool = True,
        device_staging: bool = True,
        params: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    ):
        # `params`: the weights the tags are copies of, when not all of the model's (with LoRA the
        # frozen base: the adapters are the trainer's to swap, trainer/lora.py)
        self._params: list[tuple[str, torch.nn.Parameter]] = list(
            model.named_parameters() if params is None else params
        )
        self._layout = Layout.of(self._params)
        self._pin = torch.cuda.is_available()
        self._max_slots: int | None = None
        if host_budget_bytes is not None:
            self._max_slots = host_budget_bytes // max(self.nbytes, 1)
            if self._max_slots < 2:
                raise ValueError(
                    f"snapshot host budget {host_budget_bytes} bytes holds {self._max_slots} copies of the "
                    f"weights ({self.nbytes} bytes each); it needs at least 2 (the outgoing and the incoming tag)"
                )
        # without a spill_dir a private temporary one is made at the first spill, not here: a store
        # that never spills (no host budget, or one that holds every tag) leaves nothing behind
        # when its process is killed before close()
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._slots: list[dict[torch.dtype, torch.Tensor]] = []
        self._free: list[int] = []
        self._busy: set[int] = set()  # slots a prefetch is filling (owned by no entry yet)
        self._entries: dict[str, _Entry] = {live_tag: _Entry()}
        self.live = live_tag
        self._lock = threading.RLock()
        self._tick = 0
        self._plan: list[str] = []
        self._prefetch = prefetch and self._max_slots is not None
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-prefetch")
            if self._prefetch
            else None
        )
        self._staging = (
            DeviceStaging(self._layout) if device_staging and self._pin and self._prefetch else None
        )
        self._stats = dict.fromkeys(_COUNTERS, 0.0)
        self._fingerprint = self.fingerprint()

    @property
    def spill_dir(self) -> Path:
        """Where spilled tags are written: the given directory, or a temporary one made on first use."""
        if self._spill_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="snapshots-")
            self._spill_dir = Path(self._tmp.name)
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        return self._spill_dir

    # -- introspection -----------------------------------------------------------------------
    @property
    def tags(self) -> list[str]:
        """Tags that can be switched to (the live one included)."""
        return sorted(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of one full copy of the weights."""
        return self._layout.nbytes

    @property
    def host_bytes(self) -> int:
        """CPU memory held by slots (in use or free for reuse)."""
        return len(self._slots) * self.nbytes

    def tiers(self, tag: str) -> set[str]:
        """Where `tag` has a valid copy: a subset of {"live", "host", "disk"}."""
        e = self._entries[tag]
        out = {"live"} if tag == self.live else set()
        return out | ({"host"} if e.slot is not None else set()) | ({"disk"} if e.on_disk else set())

    def __contains__(self, tag: str) -> bool:
        return tag in self._entries

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor:
        """Cheap checksum of the live weights: a strided sample of each parameter, summed in fp64."""
        parts = []
        for _, p in self._params:
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            parts.append(flat[::step].double().sum())
        return torch.stack(parts).cpu()

    # -- slots and tiers (called with the lock held) ------------------------------------------
    def _next_use(self, tag: str) -> float:
        return self._plan.index(tag) if tag in self._plan else math.inf

    def _victim(self, protect: set[str]) -> str | None:
        candidates = [
            t
            for t, e in self._entries.items()
            if e.slot is not None and t not in protect and e.slot not in self._busy
        ]
        if not candidates:
            return None

        # free to drop first (its spill file is current) — a tag that must be written costs a
        # write now and a read later; then the farthest next use; then the least recently used
        def rank(t: str) -> tuple[int, float, int]:
            e = self._entries[t]
            return (int(e.on_disk), self._next_use(t), -e.last_used)

        return max(candidates, key=rank)

    def _acquire(self, protect: set[str], needed_at: float | None = None) -> int | None:
        """A slot to fill: a free one, a new one within budget, or an evicted one.

        With `needed_at` (a prefetch) only a tag used later than that is evicted, else None.
        """
        if self._free:
            return self._free.pop()
        if self._max_slots is None or len(self._slots) < self._max_slots:
            self._slots.append(self._layout.allocate(self._pin))
            return len(self._slots) - 1
        victim = self._victim(protect)
        if victim is None:
            if needed_at is not None:
                return None
            raise RuntimeError(f"snapshot store: every host slot is in use (budget {self._max_slots} copies)")
        if needed_at is not None and self._next_use(victim) <= needed_at:
            return None
        return self._evict(victim)

    def _evict(self, tag: str) -> int:
        e = self._entries[tag]
        assert e.slot is not None
        # a copy not on disk is spilled first — also for the live tag: its parameters would do
        # for now, but the write makes every later eviction of this tag free (teachers never change)
        if not e.on_disk:
            n = write_spill(spill_path(self.spill_dir, tag), self._slots[e.slot], tag)
            self._count(host_to_disk_b=n)
            e.on_disk = True
        slot, e.slot = e.slot, None
        return slot

    def _count(self, **amounts: float) -> None:
        for k, v in amounts.items():
            self._stats[k] += v

    def _rewritten(self, tag: str) -> _Entry:
        """The entry of `tag`, about to get new contents: its spill file and staged copy are stale."""
        e = self._entries.setdefault(tag, _Entry())
        e.on_disk = False
        if self._staging is not None and self._staging.tag == tag:
            self._staging.tag = None
        return e

    def _use(self, tag: str) -> None:
        self._tick += 1
        self._entries[tag].last_used = self._tick

    @torch.no_grad()
    def _store_live(self, keep: str | None = None) -> None:
        """Gives the live tag a valid host copy (it has none after `mark_live_changed`); `keep` stays."""
        e = self._entries[self.live]
        if e.slot is not None or e.on_disk:
            return
        slot = self._acquire({self.live, keep or self.live})
        assert slot is not None
        for dst, (_, p) in zip(self._layout.views(self._slots[slot]), self._params, strict=True):
            dst.copy_(p.detach(), non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        e.slot = slot
        self._count(live_to_host_b=self.nbytes)

    def _to_host(self, tag: str, protect: set[str]) -> None:
        """Reads `tag` back from disk into a slot (on demand)."""
        e = self._entries[tag]
        if e.slot is not None:
            return
        slot = self._acquire(protect | {tag})
        assert slot is not None
        started = time.perf_counter()
        n = read_spill(spill_path(self.spill_dir, tag), self._slots[slot])
        e.slot = slot
        self._count(disk_to_host_b=n, load_s=time.perf_counter() - started, demand_loads=1)

    def _settle(self, tag: str) -> None:
        """Waits for a prefetch of `tag` in flight (without the lock: the prefetch needs it to finish),
        and for any prefetch at all when every slot is taken: the slot it fills may be the only one
        this operation could get (only the caller's thread starts prefetches, so none starts after)."""
        e = self._entries.get(tag)
        fut = e.loading if e is not None else None
        full = self._max_slots is not None and not self._free and len(self._slots) >= self._max_slots
        if fut is None and not (full and self._busy):
            return
        started = time.perf_counter()
        if fut is not None:
            fut.result()
        self.wait_prefetch()
        with self._lock:
            self._count(prefetch_wait_s=time.perf_counter() - started)

    # -- prefetch ---------------------------------------------------------------------------
    def plan(self, order: Sequence[str]) -> None:
        """The tags the caller will switch to next, in order: guides eviction and prefetch."""
        unknown = [t for t in order if t not in self._entries]
        if unknown:
            raise KeyError(f"plan names unknown snapshots {unknown} (have {self.tags})")
        with self._lock:
            self._plan = list(order)
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        """Prefetches the first planned tag that is only on disk (one load in flight at a time)."""
        with self._lock:
            todo = [t for t in self._plan if t != self.live and self._entries[t].slot is None]
        if todo:
            self.prefetch(todo[0])

    def prefetch(self, tag: str) -> None:
        """Starts bringing `tag` from disk into host memory in the background (no-op if it is there)."""
        if self._pool is None:
            return
        with self._lock:
            e = self._entries[tag]
            if e.loading is not None or e.slot is not None or not e.on_disk or tag == self.live:
                return
            e.loading = self._pool.submit(self._prefetch_job, tag)

    def wait_prefetch(self) -> None:
        """Blocks until no prefetch is in flight (benchmarks and tests; a switch waits by itself)."""
        while True:
            with self._lock:
                pending = [e.loading for e in self._entries.values() if e.loading is not None]
            if not pending:
                return
            for fut in pending:
                fut.result()

    def _prefetch_job(self, tag: str) -> None:
        e = self._entries[tag]
        try:
            with self._lock:
                slot = self._acquire({tag}, needed_at=self._next_use(tag))
                if slot is None:  # every slot holds something needed sooner: load on demand
                    return
                self._busy.add(slot)
            started = time.perf_counter()
            n = read_spill(spill_path(self.spill_dir, tag), self._slots[slot])
            if self._staging is not None:
                self._staging.stage(tag, self._slots[slot])
            elapsed = time.perf_counter() - started
            with self._lock:
                self._busy.discard(slot)
                e.slot = slot
                self._count(disk_to_host_b=n, load_s=elapsed, prefetch_load_s=elapsed, prefetches=1)
        finally:
            with self._lock:
                e.loading = None

    # -- operations --------------------------------------------------------------------------
    def save(self, tag: str) -> None:
        """Stores the live weights under `tag` (also how `ref` is taken at start-up)."""
        self._settle(tag)
        with self._lock:
            if tag == self.live:
                self._store_live()
                return
            e = self._rewritten(tag)
            if e.slot is None:
                e.slot = self._acquire({tag, self.live})
            with torch.no_grad():
                for dst, (_, p) in zip(self._layout.views(self._slots[e.slot]), self._params, strict=True):
                    dst.copy_(p.detach(), non_blocking=self._pin)
            if self._pin:
                torch.cuda.synchronize()
            self._count(live_to_host_b=self.nbytes)
            self._use(tag)

    def load(self, tag: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fills `tag` from named tensors (Megatron names of this shard) without changing the live model."""
        if tag == self.live:
            raise ValueError(f"{tag!r} is live; switch away from it before loading it")
        names = [n for n, _ in self._params]
        missing = [n for n in names if n not in tensors]
        extra = sorted(set(tensors) - set(names))
        if missing or extra:
            raise KeyError(f"snapshot {tag!r}: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, p in self._params:
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(
                    f"snapshot {tag!r}: {name} has shape {tuple(tensors[name].shape)}, model {tuple(p.shape)}"
                )
        self._settle(tag)
        with self._lock:
            e = self._rewritten(tag)
            if e.slot is None:
                e.slot = self._acquire({tag, self.live})
            for dst, name in zip(self._layout.views(self._slots[e.slot]), names, strict=True):
                dst.copy_(tensors[name])
            self._use(tag)

    def copy(self, src: str, dst: str) -> None:
        """dst := src, in CPU memory (the live model is unchanged)."""
        if src not in self._entries:
            raise KeyError(f"no snapshot {src!r} (have {self.tags})")
        if dst == self.live:
            raise ValueError(f"{dst!r} is live; use switch() to change live weights")
        self._settle(src)
        self._settle(dst)
        with self._lock:
            if src == self.live:
                self._store_live(keep=dst)
            self._to_host(src, {src, dst, self.live})
            e = self._rewritten(dst)
            if e.slot is None:
                e.slot = self._acquire({src, dst, self.live})
            source = self._entries[src].slot
            assert source is not None
            for d, s in zip(self._slots[e.slot].values(), self._slots[source].values(), strict=True):
                d.copy_(s)
            self._use(dst)

    def mark_live_changed(self) -> None:
        """The live weights changed in place (an optimizer step): every stored copy of them is stale."""
        with self._lock:
            e = self._entries[self.live]
            if e.slot is not None:
                self._free.append(e.slot)
            e.slot, e.on_disk = None, False
            if len(self._entries) == 1:
                self._fingerprint = self.fingerprint()

    def switch(self, tag: str) -> None:
        """Makes `tag` the live weights (storing the current live tag first if it has no valid copy)."""
        if tag not in self._entries:
            raise KeyError(f"no snapshot {tag!r} (have {self.tags})")
        if tag == self.live:
            if len(self._entries) == 1 and not torch.equal(self.fingerprint(), self._fingerprint):
                raise RuntimeError(
                    f"the live weights no longer match snapshot {tag!r}: something changed them "
                    "without SnapshotStore.mark_live_changed()"
                )
            self._advance(tag)
            return
        self._settle(tag)
        with self._lock:
            started = time.perf_counter()
            self._store_live(keep=tag)
            # the outgoing tag's host copy may be evicted too: eviction spills what is not on disk
            self._to_host(tag, {tag})
            e = self._entries[tag]
            assert e.slot is not None
            staged = self._staging is not None and self._staging.take(tag, self._params)
            if not staged:
                with torch.no_grad():
                    for src, (_, p) in zip(
                        self._layout.views(self._slots[e.slot]), self._params, strict=True
                    ):
                        p.data.copy_(src, non_blocking=self._pin)
                if self._pin:
                    torch.cuda.synchronize()
            self._use(self.live)
            self.live = tag
            self._use(tag)
            self._count(switches=1, switch_s=time.perf_counter() - started, host_to_live_b=self.nbytes)
            self._advance(tag)
        self._prefetch_next()

    def _advance(self, tag: str) -> None:
        with self._lock:
            if tag in self._plan:
                self._plan = self._plan[self._plan.index(tag) + 1 :]

    def drop(self, tags: Iterable[str]) -> None:
        for tag in tags:
            if tag == self.live:
                raise ValueError(f"cannot drop the live snapshot {tag!r}")
            self._settle(tag)
            with self._lock:
                e = self._entries.pop(tag, None)
                if e is not None and e.slot is not None:
                    self._free.append(e.slot)
                if self._spill_dir is not None:
                    spill_path(self._spill_dir, tag).unlink(missing_ok=True)

    def tensors(self, tag: str) -> dict[str, torch.Tensor]:
        """A copy of the stored tensors of `tag` by parameter name (read back from disk if needed)."""
        self._settle(tag)
        with self._lock:
            if tag == self.live:
                self._store_live()
            self._to_host(tag, {tag, self.live})
            slot = self._entries[tag].slot
            assert slot is not None
            views = self._layout.views(self._slots[slot])
            return {name: v.clone() for (name, _), v in zip(self._params, views, strict=True)}

    def stats(self, reset: bool = True) -> dict[str, float]:
        """perf/snap_* metrics since the last reset: bytes per tier, switch time, prefetch's hidden share."""
        with self._lock:
            s = dict(self._stats)
            if reset:
                self._stats = dict.fromkeys(_COUNTERS, 0.0)
        hidden = max(0.0, s["prefetch_load_s"] - s["prefetch_wait_s"])
        return {
            "perf/snap_switches": s["switches"],
            "perf/snap_switch_s": s["switch_s"],
            "perf/snap_live_to_host_mb": s["live_to_host_b"] / 1e6,
            "perf/snap_host_to_live_mb": s["host_to_live_b"] / 1e6,
            "perf/snap_host_to_disk_mb": s["host_to_disk_b"] / 1e6,
            "perf/snap_disk_to_host_mb": s["disk_to_host_b"] / 1e6,
            "perf/snap_disk_load_s": s["load_s"],
            "perf/snap_prefetched_loads": s["prefetches"],
            "perf/snap_demand_loads": s["demand_loads"],
            "perf/snap_prefetch_hidden_s": hidden,
            "perf/snap_prefetch_hidden_frac": hidden / s["load_s"] if s["load_s"] > 0 else 0.0,
        }

    def close(self) -> None:
        """Stops the prefetch thread and removes a spill directory the store created."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
