"""Tagged copies of the live model's weights in CPU memory: `actor`, `ref`, `teacher`, `old_actor`.

One model lives on the device; the other policies a step needs (reference for the KL, teacher for
OPD, the previous actor for one-step-off-policy training) are weight sets swapped into it. Each
tag is one flat CPU buffer per dtype (pinned when CUDA is there, so copies are DMA), holding
every parameter of this rank's shard in `named_parameters()` order.

* `switch(tag)` makes `tag` the live weights: the live tag is first saved into its own buffer if
  it changed since it was last stored (`mark_live_changed()`, called after an optimizer step),
  then `tag` is copied into the parameters.
* `copy(src, dst)` stays in CPU memory; `load(tag, tensors)` fills a tag from a checkpoint that
  was read once from disk, without touching the live model.
* With only one tag (a run without ref, teacher or old actor) the store holds no copy at all: it
  keeps a cheap fingerprint of the live weights and `switch` verifies it, so a caller that swapped
  weights behind the store's back is caught instead of silently training on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["SnapshotStore"]


class SnapshotStore:
    def __init__(self, model: torch.nn.Module, live_tag: str = "actor"):
        self._params: list[tuple[str, torch.nn.Parameter]] = list(model.named_parameters())
        self._pin = torch.cuda.is_available()
        self._buffers: dict[str, dict[torch.dtype, torch.Tensor]] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        self.live = live_tag
        self._live_dirty = True  # the live tag has no stored copy yet
        self._fingerprint = self.fingerprint()

    # -- introspection -----------------------------------------------------------------------
    @property
    def tags(self) -> list[str]:
        """Tags that can be switched to (the live one included)."""
        return sorted(set(self._buffers) | {self.live})

    @property
    def nbytes(self) -> int:
        """Bytes of one full copy of the weights."""
        return sum(p.numel() * p.element_size() for _, p in self._params)

    def __contains__(self, tag: str) -> bool:
        return tag == self.live or tag in self._buffers

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor:
        """Cheap checksum of the live weights: a strided sample of each parameter, summed in fp64."""
        parts = []
        for _, p in self._params:
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            parts.append(flat[::step].double().sum())
        return torch.stack(parts).cpu()

    # -- buffers -----------------------------------------------------------------------------
    def _allocate(self, tag: str) -> list[torch.Tensor]:
        if tag in self._views:
            return self._views[tag]
        sizes: dict[torch.dtype, int] = {}
        for _, p in self._params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        flat = {
            dtype: torch.empty(n, dtype=dtype, device="cpu", pin_memory=self._pin)
            for dtype, n in sizes.items()
        }
        offsets = dict.fromkeys(sizes, 0)
        views = []
        for _, p in self._params:
            o = offsets[p.dtype]
            views.append(flat[p.dtype][o : o + p.numel()].view(p.shape))
            offsets[p.dtype] = o + p.numel()
        self._buffers[tag], self._views[tag] = flat, views
        return views

    @torch.no_grad()
    def _store_live(self, tag: str) -> None:
        for dst, (_, p) in zip(self._allocate(tag), self._params, strict=True):
            dst.copy_(p.detach(), non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()

    @torch.no_grad()
    def _restore(self, tag: str) -> None:
        for src, (_, p) in zip(self._views[tag], self._params, strict=True):
            p.data.copy_(src, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()

    # -- operations --------------------------------------------------------------------------
    def save(self, tag: str) -> None:
        """Stores the live weights under `tag` (also how `ref` is taken at start-up)."""
        self._store_live(tag)
        if tag == self.live:
            self._live_dirty = False

    def load(self, tag: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fills `tag` from named tensors (Megatron names of this shard) without changing the live model."""
        if tag == self.live:
            raise ValueError(f"{tag!r} is live; switch away from it before loading it")
        names = [n for n, _ in self._params]
        missing = [n for n in names if n not in tensors]
        extra = sorted(set(tensors) - set(names))
        if missing or extra:
            raise KeyError(f"snapshot {tag!r}: missing {missing[:5]}, unexpected {extra[:5]}")
        views = self._allocate(tag)
        for dst, (name, p) in zip(views, self._params, strict=True):
            src = tensors[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(
                    f"snapshot {tag!r}: {name} has shape {tuple(src.shape)}, model {tuple(p.shape)}"
                )
            dst.copy_(src)

    def copy(self, src: str, dst: str) -> None:
        """dst := src, in CPU memory (the live model is unchanged unless dst is live)."""
        if src == self.live and self._live_dirty:
            self._store_live(src)
            self._live_dirty = False
        if src not in self._buffers:
            raise KeyError(f"no snapshot {src!r} (have {self.tags})")
        if dst == self.live:
            raise ValueError(f"{dst!r} is live; use switch() to change live weights")
        target = self._allocate(dst)
        for d, s in zip(target, self._views[src], strict=True):
            d.copy_(s)

    def mark_live_changed(self) -> None:
        """The live weights changed in place (an optimizer step): the stored copy is stale."""
        self._live_dirty = True
        if not self._buffers or set(self._buffers) == {self.live}:
            self._fingerprint = self.fingerprint()

    def switch(self, tag: str) -> None:
        """Makes `tag` the live weights (saving the current live tag first if it changed)."""
        if tag == self.live:
            if not self._buffers and not torch.equal(self.fingerprint(), self._fingerprint):
                raise RuntimeError(
                    f"the live weights no longer match snapshot {tag!r}: something changed them "
                    "without SnapshotStore.mark_live_changed()"
                )
            return
        if tag not in self._buffers:
            raise KeyError(f"no snapshot {tag!r} (have {self.tags})")
        if self._live_dirty:
            self._store_live(self.live)
        self._restore(tag)
        self.live = tag
        self._live_dirty = False

    def drop(self, tags: Iterable[str]) -> None:
        for tag in tags:
            if tag == self.live:
                raise ValueError(f"cannot drop the live snapshot {tag!r}")
            self._buffers.pop(tag, None)
            self._views.pop(tag, None)

    def tensors(self, tag: str) -> dict[str, torch.Tensor]:
        """The stored tensors of `tag` by parameter name (views into the CPU buffer)."""
        if tag == self.live and self._live_dirty:
            self._store_live(tag)
            self._live_dirty = False
        return {name: v for (name, _), v in zip(self._params, self._views[tag], strict=True)}
