"""LoRA adapters in the embedded engine, served the way SGLang serves them (docs/engine-protocol.md,
"LoRA adapters").

* Files: PEFT's layout, which `peft`, SGLang and the trainer's export share, read and checked by
  `palaestra.weights_format.read_adapter` (the format is described there).
* Base model: an adapter written by the trainer carries the checksum of the base weights it was
  trained on (`palaestra.weights_format.base_checksum`); loading it onto an engine whose weights
  have another checksum is refused. Files without one (PEFT's own) are checked by shape only.
* Math: every adapted ``nn.Linear`` of the transformers model gets a forward hook adding
  (α/r)·B·(A·x) — scale α/√r with ``use_rslora`` — for the rows of the batch whose request names
  that adapter (`LoraManager.rows`): one decode step serves requests of several adapters and of the
  base model at once. The parameter names of the model do not change (full-weight updates keep
  working) and a model without adapters runs no hook at all.

`LoraManager` holds the resident adapters by name. Each load gets a new `uid`: the prefix cache
keys KV by it (an adapter's KV is not the base model's), so loading an adapter needs no flush.

Loading is cheap where it can be, so that a sync's swap inside a pause is short: the base checksum
is computed once per version of the base weights (`LoraManager.weights_changed` forgets it), and a
load of files already resident under another name — the same directory, unchanged since
(`palaestra.weights_format.files_stamp`) — shares that adapter's factors instead of reading them again. The trainer's sync
loads each new version under a name of its own while the engine still generates, then swaps the
served name to it inside the pause (trainer/lora_sync.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from palaestra.engine.protocol import RequestError
from palaestra.weights_format import AdapterFiles, base_checksum

__all__ = ["NOT_ENABLED", "LoraAdapter", "LoraManager", "parse_lora_paths"]

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer to a LoRA call on a server started without LoRA (word for word)."""


def parse_lora_paths(items: Sequence[str]) -> list[tuple[str, str]]:
    """``--lora-paths`` entries as SGLang takes them: ``NAME=PATH``, ``PATH`` (named after its
    directory), or JSON ``{"lora_name": ..., "lora_path": ...}``."""
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            obj = json.loads(item)
            out.append((str(obj["lora_name"]), str(obj["lora_path"])))
        elif "=" in item:
            name, path = item.split("=", 1)
            out.append((name, path))
        else:
            out.append((Path(item).name, item))
    return out


_uids = itertools.count(1)


@dataclass(eq=False)
class LoraAdapter:
    """One resident adapter: its factors per module (float, the model's dtype) and its scale; the
    files it was read from and their `files_stamp`, for a later load of the same files."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    pinned: bool = False
    uid: int = field(default_factory=lambda: next(_uids))
    files: AdapterFiles | None = None
    stamp: tuple[int, ...] | None = None


class LoraManager:
    """The resident adapters of one model and the hooks that apply them (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int | None = None,
        max_lora_rank: int | None = None,
        target_modules: Sequence[str] | None = None,
    ):
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        self.max_lora_rank = max_lora_rank
        self.target_modules = list(target_modules) if target_modules else None
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooks: dict[str, Any] = {}
        self._active: list[tuple[LoraAdapter, torch.Tensor | None]] = []
        # of the current base weights; None: not computed since they last changed
        self._checksum: str | None = None

    # -- the base weights -----------------------------------------------------------------------
    def base_checksum(self) -> str:
        """`base_checksum` of the model's weights, computed once per version of them."""
        if self._checksum is None:
            self._checksum = base_checksum(self.model.named_parameters())
        return self._checksum

    def weights_changed(self) -> None:
        """The base weights were updated: the next check computes their checksum again."""
        self._checksum = None

    # -- checks (any thread) --------------------------------------------------------------------
    def check(self, name: str, files: AdapterFiles) -> None:
        """Refuses an adapter this engine cannot serve: another base model (checksum), a module the
        model lacks or of another shape, limits of the server's options."""
        if name in self.adapters:
            raise RequestError(
                f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)} "
                "(unload it first: /unload_lora_adapter)"
            )
        if self.max_loaded_loras is not None and len(self.adapters) >= self.max_loaded_loras:
            raise RequestError(
                f"max_loaded_loras is {self.max_loaded_loras} and that many adapters are loaded "
                f"({list(self.adapters)}); unload one first"
            )
        if files.base_checksum is not None:
            here = self.base_checksum()
            if files.base_checksum != here:
                raise RequestError(
                    f"the adapter at {files.path} was trained on another base model (base checksum "
                    f"{files.base_checksum}); this engine's weights have checksum {here}. Load it on "
                    f"an engine serving the model it was trained from"
                )
        if self.max_lora_rank is not None and files.rank > self.max_lora_rank:
            raise RequestError(
                f"the adapter's rank {files.rank} exceeds --max-lora-rank {self.max_lora_rank}"
            )
        for module, (a, b) in files.weights.items():
            linear = self.linears.get(module)
            if linear is None:
                raise RequestError(
                    f"the adapter at {files.path} adapts {module!r}, which this model does not have "
                    f"(its projections look like {next(iter(self._projection_names()), '?')})"
                )
            out_dim, in_dim = linear.weight.shape
            if a.shape[1] != in_dim or b.shape[0] != out_dim:
                raise RequestError(
                    f"{module}: the adapter's factors are {tuple(a.shape)} and {tuple(b.shape)}, the "
                    f"model's weight is {out_dim} x {in_dim}: another base model"
                )
            short = module.rsplit(".", 1)[-1]
            if self.target_modules and "all" not in self.target_modules and short not in self.target_modules:
                raise RequestError(
                    f"the adapter adapts {short}, not in --lora-target-modules {self.target_modules}"
                )

    def _projection_names(self) -> Iterator[str]:
        return (n for n in self.linears if ".layers.0." in n)

    def prepare(self, files: AdapterFiles) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The factors of `files` in the model's dtype (any thread: it touches no model state)."""
        return {
            m: (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
            for m, (a, b) in files.weights.items()
        }

    def resident(self, path: str, stamp: tuple[int, ...] | None) -> LoraAdapter | None:
        """A resident adapter read from `path` when its files had `stamp` (None: none is)."""
        if stamp is None:
            return None
        for adapter in list(self.adapters.values()):
            if adapter.path == path and adapter.stamp == stamp:
                return adapter
        return None

    def get(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise RequestError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {list(self.adapters)}."
            )
        return adapter

    # -- changes (the scheduler thread: hooks and tensors are the model's) -----------------------
    def add(
        self,
        name: str,
        files: AdapterFiles,
        pinned: bool = False,
        *,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        stamp: tuple[int, ...] | None = None,
    ) -> LoraAdapter:
        """Makes `files` resident as `name`; `weights`: its factors already `prepare`d (shared
        with another adapter of the same files), `stamp`: its files' `files_stamp`."""
        self.check(name, files)
        if weights is None:
            weights = self.prepare(files)
        adapter = LoraAdapter(
            name, files.path, files.rank, files.scale, weights, pinned, files=files, stamp=stamp
        )
        for module in weights:
            if module not in self._hooks:
                self._hooks[module] = self.linears[module].register_forward_hook(self._hook(module))
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> LoraAdapter:
        """Unregisters `name` (new requests may no longer name it); requests holding it keep it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:  # SGLang's words: the trainer's sync reads "does not exist" as not loaded yet
            raise RequestError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
        return adapter

    def loaded(self) -> dict[str, str]:
        """name -> path of every resident adapter (SGLang's ``loaded_adapters``)."""
        return {n: a.path for n, a in self.adapters.items()}

    # -- a forward pass -------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, adapters: Sequence[LoraAdapter | None]) -> Iterator[None]:
        """Row i of the next forward passes uses `adapters[i]` (None: the base model)."""
        groups: dict[LoraAdapter, list[int]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                groups.setdefault(a, []).append(i)
        whole = len(groups) == 1 and len(next(iter(groups.values()))) == len(adapters)
        self._active = [
            (a, None if whole else torch.tensor(rows, dtype=torch.long)) for a, rows in groups.items()
        ]
        try:
            yield
        finally:
            self._active = []

    def _hook(self, module_name: str):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            for adapter, rows in self._active:
                w = adapter.weights.get(module_name)
                if w is None:
                    continue
                a, b = w
                if rows is None:  # every row uses this adapter (a prefill, or a one-adapter batch)
                    out = out + adapter.scale * F.linear(F.linear(args[0], a), b)
                else:
                    x = args[0].index_select(0, rows)
                    out = out.index_add(0, rows, adapter.scale * F.linear(F.linear(x, a), b))
            return out

        return hook
