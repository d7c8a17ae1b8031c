"""Loading `/update_weights_from_disk` and `/update_weights_from_tensor` payloads into the model.

Disk: a directory (or one file) of safetensors with HF parameter names, as `save_pretrained` writes.
`load_safetensors_into` reads each tensor's bytes straight into the model's parameter (one copy,
no intermediate tensor) when dtype and layout match — the in-host fast path, where the trainer
writes the file into /dev/shm (`palaestra.trainer.shm_sync`). It checks every name, shape, dtype
and offset against the model and the file size before it changes anything.

Tensor (in-host): `serialized_named_tensors` is a list of base64 strings, one per TP rank (the
embedded engine has one rank, so exactly one string), decoded by
`palaestra.weights_format.deserialize_named_tensors` (the layout is described there). SGLang itself
pickles CUDA IPC handles here (zero-copy between processes on one GPU); a CPU engine has no such
handles, so it takes the bytes.

The safetensors dtype table and the file formats both sides share live in
`palaestra.weights_format`.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import torch

from palaestra.engine.protocol import RequestError
from palaestra.weights_format import SAFETENSORS_DTYPES, FormatError, safetensors_files


def _safetensors_files(path: str | Path) -> list[Path]:
    try:
        return safetensors_files(path)
    except FormatError as exc:  # a request naming a missing or empty path: the client's error
        raise RequestError(str(exc)) from None


def safetensors_names(path: str | Path) -> set[str]:
    """The tensor names of the safetensors file(s) at `path` (their headers only)."""
    names: set[str] = set()
    for file in _safetensors_files(path):
        with open(file, "rb") as f:
            names |= set(_read_header(f, file)[1])
    return names


def _read_header(f, path: Path) -> tuple[int, dict[str, dict]]:
    """(start of the data section, {name: {dtype, shape, data_offsets}}), validated against the file size."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if n < 2 or 8 + n > size:
        raise RequestError(f"{path}: not a safetensors file (header length {n}, file size {size})")
    try:
        header = json.loads(f.read(n))
    except ValueError as exc:
        raise RequestError(f"{path}: bad safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    base = 8 + n
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if dtype is None:
            raise RequestError(f"{path}: tensor {name!r} has an unsupported dtype")
        start, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= int(d)
        if not 0 <= start <= end or base + end > size or end - start != numel * dtype.itemsize:
            raise RequestError(f"{path}: tensor {name!r} has inconsistent offsets/shape")
        info["torch_dtype"] = dtype
    return base, header


def load_safetensors_into(path: str | Path, params: dict[str, torch.Tensor]) -> int:
    """Reads every tensor of the safetensors file(s) at `path` into `params[name]` (in place).

    Validates all names and shapes before the first write. A parameter with the file's dtype that
    is contiguous on CPU receives the bytes directly (`readinto`); otherwise the bytes are read
    into a scratch tensor and converted. Returns the number of tensors loaded.
    """
    files = _safetensors_files(path)
    handles, plans = [], []
    count = 0
    try:
        for file in files:  # everything is checked before the first byte is written
            handles.append(open(file, "rb", buffering=0))  # noqa: SIM115 - closed in `finally`
            base, header = _read_header(handles[-1], file)
            _check_names(header, params)
            plans.append((handles[-1], base, header))
        with torch.inference_mode(False), torch.no_grad():
            for f, base, header in plans:
                for name, info in header.items():
                    param, dtype = params[name], info["torch_dtype"]
                    start, end = info["data_offsets"]
                    direct = param.dtype == dtype and param.device.type == "cpu" and param.is_contiguous()
                    target = param if direct else torch.empty(param.shape, dtype=dtype)
                    view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
                    got = os.preadv(f.fileno(), [view], base + start) if end > start else 0
                    if got != end - start:
                        raise RequestError(f"short read of {name}: {got} of {end - start} bytes")
                    if not direct:
                        param.copy_(target)
                    count += 1
    finally:
        for f in handles:
            f.close()
    return count


class SharedSafetensors:
    """A safetensors file the model's parameters point into (``load_format: "mmap"``).

    `share(path, params)` maps the (single) file read-write and sets each parameter's data to its
    bytes in the mapping: no copy, and every engine on the host shares one copy of the weights.
    The writer (the trainer's `SharedWeightsFile`) rewrites the bytes in place while the engine is
    paused; sharing the same file again only checks that the parameters still point into it (and
    refreshes the few that had to be copied).
    A parameter whose dtype differs from the file's, or is not on CPU, is copied instead.
    """

    def __init__(self) -> None:
        self.key: tuple[str, int, bytes] | None = None  # path, inode, header
        self._map: mmap.mmap | None = None
        self._addresses: dict[str, int] = {}

    def share(self, path: str | Path, params: dict[str, torch.Tensor]) -> int:
        files = _safetensors_files(path)
        if len(files) != 1:
            raise RequestError(
                f"load_format 'mmap' needs exactly one safetensors file; {path} has {len(files)}"
            )
        with open(files[0], "r+b") as f:  # read-write: torch views need a writable buffer
            base, header = _read_header(f, files[0])
            f.seek(0)
            key = (str(files[0]), os.fstat(f.fileno()).st_ino, f.read(base))
            _check_names(header, params)
            same = key == self.key and all(params[n].data_ptr() == a for n, a in self._addresses.items())
            # the same file, still shared: only the copied parameters need the writer's new bytes
            mapping = self._map if same and self._map is not None else mmap.mmap(f.fileno(), 0)
        addresses = dict(self._addresses) if same else {}
        with torch.inference_mode(False), torch.no_grad():
            for name, info in header.items():
                if name in addresses:
                    continue
                param, dtype = params[name], info["torch_dtype"]
                start, end = info["data_offsets"]
                offset = base + start
                count = (end - start) // dtype.itemsize
                if not count:  # an empty tensor has no bytes to share or copy
                    continue
                view = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(info["shape"])
                if param.dtype == dtype and param.device.type == "cpu" and offset % dtype.itemsize == 0:
                    param.data = view
                    addresses[name] = param.data_ptr()
                else:
                    param.copy_(view)
        self.key, self._map, self._addresses = key, mapping, addresses  # an old mapping lives while used
        return len(header)


def _check_names(header: dict[str, dict], params: dict[str, torch.Tensor]) -> None:
    if not header:
        raise RequestError("no tensors in the update")
    for name, info in header.items():
        if name not in params:
            raise RequestError(f"unknown parameter {name!r} for this model")
        if tuple(info["shape"]) != tuple(params[name].shape):
            raise RequestError(
                f"shape mismatch for {name}: got {tuple(info['shape'])}, model has {tuple(params[name].shape)}"
            )
