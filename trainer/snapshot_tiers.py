"""The storage tiers under `SnapshotStore`: host slots, safetensors spill files, a device staging copy.

A *slot* is one full copy of this rank's weights in CPU memory: one flat buffer per dtype (pinned
when CUDA is there, so host-to-device copies are DMA), with a view per parameter in
`named_parameters()` order (`Layout`). Every tag of a store has the same layout, so a slot freed by
one tag is reused by the next without allocating again (pinned allocation is slow: it locks pages).

A spilled tag is one safetensors file, `<spill_dir>/<tag with / as __>.safetensors`, holding the
flat buffers under their dtype names (``"bfloat16"``, ``"float32"``, ...) — a valid safetensors
file that `safetensors.safe_open` reads too. `read_spill` memory-maps it and copies each dtype's
bytes straight into a slot (one copy, from the page cache); `write_spill` writes the slot's bytes
without an intermediate buffer. Neither calls fsync: a spill file is scratch, valid for this
process only, and the page cache is what makes a re-read cheap.

`DeviceStaging` (CUDA only) is one more copy of the weights on the device, filled from a slot on a
side stream by the prefetch thread, so that the switch itself is a device-to-device copy.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from palaestra.weights_format import safetensors_dtype

__all__ = ["DeviceStaging", "Layout", "read_spill", "spill_path", "write_spill"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Layout:
    """Where each parameter lives inside a slot: (dtype, offset, shape) in `named_parameters()` order."""

    names: tuple[str, ...]
    places: tuple[tuple[torch.dtype, int, torch.Size], ...]
    sizes: tuple[tuple[torch.dtype, int], ...]  # elements per dtype, first-seen order

    @classmethod
    def of(cls, params: list[tuple[str, torch.Tensor]]) -> Layout:
        sizes: dict[torch.dtype, int] = {}
        places = []
        for _, p in params:
            o = sizes.get(p.dtype, 0)
            places.append((p.dtype, o, p.shape))
            sizes[p.dtype] = o + p.numel()
        return cls(tuple(n for n, _ in params), tuple(places), tuple(sizes.items()))

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for d, n in self.sizes)

    def allocate(self, pin: bool) -> dict[torch.dtype, torch.Tensor]:
        """One empty slot: a flat CPU buffer per dtype."""
        return {d: torch.empty(n, dtype=d, device="cpu", pin_memory=pin) for d, n in self.sizes}

    def views(self, flat: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter views into a slot (or into a device staging buffer of the same layout)."""
        return [flat[d][o : o + s.numel()].view(s) for d, o, s in self.places]


def spill_path(spill_dir: Path, tag: str) -> Path:
    return spill_dir / (tag.replace("/", "__") + ".safetensors")


def write_spill(path: Path, flat: dict[torch.dtype, torch.Tensor], tag: str) -> int:
    """Writes a slot as a safetensors file (written to a temporary name, then renamed); returns bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "palaestra-snapshot", "tag": tag}}
    offset = 0
    for dtype, t in flat.items():
        n = t.numel() * t.element_size()
        header[_dtype_name(dtype)] = {
            "dtype": safetensors_dtype(dtype),
            "shape": [t.numel()],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in flat.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
    tmp.replace(path)
    return offset


def read_spill(path: Path, flat: dict[torch.dtype, torch.Tensor]) -> int:
    """Copies a spill file into a slot through a memory map; returns the bytes read."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    total = 0
    for dtype, dst in flat.items():
        entry = header.get(_dtype_name(dtype))
        if entry is None or entry["shape"] != [dst.numel()]:
            raise ValueError(f"spill file {path}: {_dtype_name(dtype)} is {entry}, expected [{dst.numel()}]")
        a, b = entry["data_offsets"]
        # mode "c" (copy-on-write) gives a writable array, so torch wraps it without a warning;
        # nothing writes to it, so no page is ever copied.
        mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=start + a, shape=(b - a,))
        dst.view(torch.uint8).copy_(torch.from_numpy(mapped))
        del mapped
        total += b - a
    return total


class DeviceStaging:
    """One device copy of the weights, filled on a side stream by the prefetch thread (CUDA only)."""

    def __init__(self, layout: Layout):
        self._layout = layout
        self._flat: dict[torch.dtype, torch.Tensor] | None = None
        self._stream = torch.cuda.Stream()
        self._ready = torch.cuda.Event()
        self._consumed: torch.cuda.Event | None = None
        self.tag: str | None = None

    def stage(self, tag: str, slot: dict[torch.dtype, torch.Tensor]) -> None:
        dev = torch.device("cuda", torch.cuda.current_device())
        if self._flat is None:
            self._flat = {d: torch.empty(n, dtype=d, device=dev) for d, n in self._layout.sizes}
        self.tag = None
        with torch.cuda.stream(self._stream):
            if self._consumed is not None:  # the last switch may still be reading the buffer
                self._stream.wait_event(self._consumed)
            for d, src in slot.items():
                self._flat[d].copy_(src, non_blocking=True)
            self._ready.record(self._stream)
        # The pinned slot must not be reused before the copy has read it: wait here, in the
        # prefetch thread, rather than in the switch.
        self._ready.synchronize()
        self.tag = tag

    def take(self, tag: str, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
        """Copies the staged weights into the parameters (device to device) if `tag` is staged."""
        if self.tag != tag or self._flat is None:
            return False
        torch.cuda.current_stream().wait_event(self._ready)
        with torch.no_grad():
            for src, (_, p) in zip(self._layout.views(self._flat), params, strict=True):
                p.data.copy_(src)
        self._consumed = torch.cuda.Event()
        self._consumed.record(torch.cuda.current_stream())
        self.tag = None
        return True
