"""The weight file formats the trainer writes and the engine reads: one module both sides import.

* safetensors: the dtype codes (`SAFETENSORS_DTYPES`, `safetensors_dtype`) every writer of a raw
  header uses (`trainer/shm_sync.py`, `trainer/snapshot_tiers.py`) and the engine's reader checks
  against (`engine/weights.py`); `safetensors_files` and `read_safetensors` for a directory of them.
* ``/update_weights_from_tensor`` payloads: `serialize_named_tensors` (the trainer's
  ``sync_mode: tensor``) and `deserialize_named_tensors` (the embedded engine). One base64 string
  per TP rank, the base64 of a `torch.save` archive of either a list of ``(name, tensor)`` pairs
  (``load_format`` null or ``"direct"``) or, for ``"flattened_bucket"``, SGLang's bucket layout
  ``{"flattened_tensor": 1-D tensor, "metadata": [{"name", "shape", "dtype", "start_idx",
  "end_idx", "numel"}, ...]}``. Reading uses ``torch.load(weights_only=True)``: a payload cannot
  run code.
* PEFT LoRA directories: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...)
  and ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` [r, in] and
  ``...lora_B.weight`` [out, r] per adapted projection), the layout `peft`, SGLang, the trainer's
  export and its adapter sync share. `write_adapter` writes one (the trainer), `read_adapter` reads
  and checks one (the engine). An adapter the trainer writes carries the checksum of the base
  weights it was trained on (`base_checksum`, in the safetensors metadata under
  `BASE_CHECKSUM_KEY`); `files_stamp` tells whether a directory's files changed since.
* Files users load elsewhere (exports, adapters, built presets) are written by `save_safetensors`:
  safetensors' own writer leaves them mode 0600, which other users and containers cannot read.

Everything wrong with a file or payload is a `FormatError` (a ValueError) that says what is wrong;
the engine answers it as a client error.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BASE_CHECKSUM_KEY",
    "CONFIG_FILE",
    "SAFETENSORS_DTYPES",
    "WEIGHTS_FILE",
    "AdapterFiles",
    "FormatError",
    "base_checksum",
    "deserialize_named_tensors",
    "files_stamp",
    "read_adapter",
    "read_safetensors",
    "safetensors_dtype",
    "safetensors_files",
    "save_safetensors",
    "serialize_named_tensors",
    "write_adapter",
]


class FormatError(ValueError):
    """A weights file, directory or payload that is not what it should be (the message says how)."""


# -- safetensors ------------------------------------------------------------------------------
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype codes (the "dtype" of a header entry) and their torch dtypes: the one table
that the engine's reader (`engine/weights.py`) and the trainer's writers (`trainer/shm_sync.py`,
`trainer/snapshot_tiers.py`) use."""

_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (``torch.bfloat16`` -> ``"BF16"``); a ValueError for a
    dtype safetensors cannot hold."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be written to safetensors (it holds {', '.join(SAFETENSORS_DTYPES)})"
        ) from None


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a directory (sorted), or `path` itself if it is a file."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FormatError(f"no *.safetensors files in {p}")
        return files
    if p.is_file():
        return [p]
    raise FormatError(f"model_path {str(p)!r} does not exist")


def read_safetensors(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors file(s) at `path` (a directory or one file), by name."""
    from safetensors.torch import load_file

    named: list[tuple[str, torch.Tensor]] = []
    for f in safetensors_files(path):
        try:
            named.extend(load_file(str(f)).items())
        except Exception as exc:  # corrupt/unsafe file: the caller's error, not a crash
            raise FormatError(f"cannot read {f}: {exc}") from None
    return named


# -- /update_weights_from_tensor payloads -----------------------------------------------------
def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """`{"flattened_tensor", "metadata"}` of SGLang's `load_format: "flattened_bucket"`: the tensors
    one after another in one flat tensor (one dtype: a mixed bucket goes up to float32), with each
    one's name, shape, dtype and [start_idx, end_idx) in it."""
    metadata, flats, offset = [], [], 0
    for name, t in named:
        flat = t.detach().reshape(-1)
        metadata.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "start_idx": offset,
                "end_idx": offset + flat.numel(),
                "numel": flat.numel(),
            }
        )
        flats.append(flat)
        offset += flat.numel()
    if len({f.dtype for f in flats}) > 1:
        flats = [f.to(torch.float32) for f in flats]
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], flattened: bool = False) -> str:
    """Encodes tensors the way `/update_weights_from_tensor` expects them (one rank)."""
    buf = io.BytesIO()
    if flattened:
        torch.save(flattened_bucket(named), buf)
    else:
        torch.save([(name, t.detach().contiguous()) for name, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: list[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a `serialize_named_tensors` payload (one rank)."""
    if not isinstance(payload, list) or len(payload) != 1 or not isinstance(payload[0], str):
        raise FormatError("serialized_named_tensors must be a list with one base64 string (tp_size is 1)")
    try:
        obj = torch.load(io.BytesIO(base64.b64decode(payload[0], validate=True)), weights_only=True)
    except Exception as exc:
        raise FormatError(f"cannot decode serialized_named_tensors: {exc}") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise FormatError("flattened_bucket payload must be {'flattened_tensor': ..., 'metadata': [...]}")
        flat = obj["flattened_tensor"]
        out = []
        for m in obj["metadata"]:
            dtype = getattr(torch, m.get("dtype", "float32"))
            out.append((m["name"], flat[m["start_idx"] : m["end_idx"]].reshape(m["shape"]).to(dtype)))
        return out
    if load_format not in (None, "direct"):
        raise FormatError(
            f"load_format {load_format!r} is not supported (null, 'direct', 'flattened_bucket')"
        )
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(x, (list, tuple))
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], torch.Tensor)
        for x in obj
    ):
        raise FormatError("payload must be a list of (name, tensor) pairs")
    return [(name, t) for name, t in obj]


# -- PEFT LoRA directories --------------------------------------------------------------------
BASE_CHECKSUM_KEY = "palaestra_base_checksum"
"""The safetensors metadata key of the base model's checksum (`base_checksum`)."""

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
    """Reads and checks a PEFT LoRA directory; a FormatError says what is wrong with it."""
    from safetensors import safe_open

    p = Path(path)
    cfg_file, weights_file = p / CONFIG_FILE, p / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        raise FormatError(
            f"lora_path {str(p)!r} is not a PEFT LoRA adapter directory (it needs {CONFIG_FILE} and "
            f"{WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise FormatError(f"{cfg_file}: not JSON: {exc}") from None
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise FormatError(f"{cfg_file}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key, allowed in (
        ("use_dora", (False, None)),
        ("bias", ("none", None)),
        ("modules_to_save", (None, [])),
    ):
        if cfg.get(key) not in allowed:
            raise FormatError(f"{cfg_file}: {key}={cfg.get(key)!r} is not supported (LoRA factors only)")
    rank = cfg.get("r")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise FormatError(f"{cfg_file}: r must be a positive integer and lora_alpha a number")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise FormatError(f"{cfg_file}: per-module rank_pattern/alpha_pattern is not supported")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            checksum = (f.metadata() or {}).get(BASE_CHECKSUM_KEY)
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                    raise FormatError(f"{weights_file}: unexpected tensor {key!r} (LoRA factors only)")
                module, factor = key[len(_PREFIX) :].rsplit(".lora_", 1)
                pairs.setdefault(module, {})[factor[0]] = f.get_tensor(key)
    except FormatError:
        raise
    except Exception as exc:  # a corrupt file is the caller's error
        raise FormatError(f"cannot read {weights_file}: {exc}") from None
    weights = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise FormatError(f"{weights_file}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise FormatError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {rank} needs [r, in] and [out, r]"
            )
        weights[module] = (a, b)
    if not weights:
        raise FormatError(f"{weights_file}: no LoRA factors")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    return AdapterFiles(str(p), rank, float(alpha), scale, targets, weights, checksum, cfg)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> Path:
    """`safetensors.torch.save_file`, then mode 0644 (what every other file of a model directory
    has): safetensors writes through a private temporary file and keeps its mode, 0600.
    (Reading the umask to honour it would briefly change it for every thread of the process.)"""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o644)
    return Path(path)


def write_adapter(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    base_checksum: str | None = None,
) -> Path:
    """Writes a PEFT LoRA directory (config + safetensors with PEFT's names), atomically: into
    ``<path>.tmp`` first, renamed into place."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    metadata = {"format": "pt"}
    if base_checksum is not None:
        metadata[BASE_CHECKSUM_KEY] = base_checksum
    save_safetensors(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS_FILE, metadata
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
