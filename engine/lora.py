"""LoRA adapters in the embedded engine, served the way SGLang serves them (docs/engine-protocol.md,
"LoRA adapters").

* Files: PEFT's layout, which `peft`, SGLang and the trainer's export share — a directory with
  ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
  ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` [r, in] and
  ``...lora_B.weight`` [out, r] per adapted projection). `read_adapter` reads and checks them.
* Base model: an adapter written by the trainer carries the checksum of the base weights it was
  trained on (`base_checksum`, in the safetensors metadata under `BASE_CHECKSUM_KEY`); loading it
  onto an engine whose weights have another checksum is refused. Files without one (PEFT's own)
  are checked by shape only.
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
(`files_stamp`) — shares that adapter's factors instead of reading them again. The trainer's sync
loads each new version under a name of its own while the engine still generates, then swaps the
served name to it inside the pause (trainer/lora_sync.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from palaestra.engine.protocol import RequestError

__all__ = [
    "BASE_CHECKSUM_KEY",
    "NOT_ENABLED",
    "AdapterFiles",
    "LoraAdapter",
    "LoraManager",
    "base_checksum",
    "files_stamp",
    "parse_lora_paths",
    "read_adapter",
    "write_adapter",
]

BASE_CHECKSUM_KEY = "palaestra_base_checksum"
"""The safetensors metadata key of the base model's checksum (`base_checksum`)."""

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer to a LoRA call on a server started without LoRA (word for word)."""

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def base_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A checksum of model weights by HF name: each tensor's name, shape and 4096 evenly spaced
    values (as float32). The trainer and the engine compute the same one from the same weights
    (whatever dtype they were stored in), in milliseconds for a 135 M model; a different base
    model — or the same one fine-tuned — differs in every sampled tensor."""
    digest = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        flat = t.detach().reshape(-1)
        n = flat.numel()
        # float64: float32 positions round past the end beyond 2**24 values (an embedding)
        idx = torch.linspace(0, max(n - 1, 0), steps=min(n, 4096), dtype=torch.float64).round().long()
        digest.update(f"{name}{tuple(t.shape)}".encode())
        digest.update(flat[idx].to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass
class AdapterFiles:
    """A PEFT LoRA adapter as read from disk: module path (``model.layers.0.self_attn.q_proj``) ->
    (A [r, in], B [out, r])."""

    path: str
    rank: int
    alpha: float
    scale: float
    targets: list[str]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_checksum: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(path: str | Path) -> AdapterFiles:
    """Reads and checks a PEFT LoRA directory; a RequestError says what is wrong with it."""
    from safetensors import safe_open

    p = Path(path)
    cfg_file, weights_file = p / CONFIG_FILE, p / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        raise RequestError(
            f"lora_path {str(p)!r} is not a PEFT LoRA adapter directory (it needs {CONFIG_FILE} and "
            f"{WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise RequestError(f"{cfg_file}: not JSON: {exc}") from None
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise RequestError(
            f"{cfg_file}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served"
        )
    for key, allowed in (
        ("use_dora", (False, None)),
        ("bias", ("none", None)),
        ("modules_to_save", (None, [])),
    ):
        if cfg.get(key) not in allowed:
            raise RequestError(f"{cfg_file}: {key}={cfg.get(key)!r} is not supported (LoRA factors only)")
    rank = cfg.get("r")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise RequestError(f"{cfg_file}: r must be a positive integer and lora_alpha a number")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise RequestError(f"{cfg_file}: per-module rank_pattern/alpha_pattern is not supported")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            checksum = (f.metadata() or {}).get(BASE_CHECKSUM_KEY)
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                    raise RequestError(f"{weights_file}: unexpected tensor {key!r} (LoRA factors only)")
                module, factor = key[len(_PREFIX) :].rsplit(".lora_", 1)
                pairs.setdefault(module, {})[factor[0]] = f.get_tensor(key)
    except RequestError:
        raise
    except Exception as exc:  # a corrupt file is the caller's error
        raise RequestError(f"cannot read {weights_file}: {exc}") from None
    weights = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise RequestError(f"{weights_file}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise RequestError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {rank} needs [r, in] and [out, r]"
            )
        weights[module] = (a, b)
    if not weights:
        raise RequestError(f"{weights_file}: no LoRA factors")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    return AdapterFiles(str(p), rank, float(alpha), scale, targets, weights, checksum, cfg)


def write_adapter(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    base_checksum: str | None = None,
) -> Path:
    """Writes a PEFT LoRA directory (config + safetensors with PEFT's names), atomically: into
    ``<path>.tmp`` first, renamed into place."""
    import shutil

    from safetensors.torch import save_file

    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    metadata = {"format": "pt"}
    if base_checksum is not None:
        metadata[BASE_CHECKSUM_KEY] = base_checksum
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(tmp / WEIGHTS_FILE),
        metadata=metadata,
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def files_stamp(path: str | Path) -> tuple[int, ...] | None:
    """The identity of a PEFT directory's two files (inode, size, modification time of each); None
    when either is missing. Equal stamps: the same bytes as when the stamp was taken (a writer that
    replaces the files, as `write_adapter` does, changes the inodes)."""
    p = Path(path)
    try:
        stats = (os.stat(p / CONFIG_FILE), os.stat(p / WEIGHTS_FILE))
    except OSError:
        return None
    return tuple(x for s in stats for x in (s.st_ino, s.st_size, s.st_mtime_ns))


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
