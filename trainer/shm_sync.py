"""The in-host fast path of weight sync: one safetensors file in shared memory, written in place.

    shm = SharedWeightsFile()                 # /dev/shm/palaestra-weights-<pid>-<random>/
    directory = shm.write(named)              # raw tensor bytes, dtype kept, one copy
    # every engine on this host: POST /update_weights_from_disk {"model_path": directory}
    shm.close()                               # removes the directory

The file is an ordinary ``model.safetensors`` (8-byte header length, JSON header, raw bytes), so
anything that reads safetensors loads it: the embedded engine (which reads each tensor straight
into its parameter, `palaestra.engine.weights.load_safetensors_into`) and real SGLang's
``/update_weights_from_disk`` alike. No JSON or base64 carries tensor data, and bf16 stays bf16.

Why it is fast: the file lives on tmpfs, so "writing" is one kernel copy into page-cache pages and
"reading" one copy out of them. The file is kept between syncs and rewritten in place when the
names, dtypes and shapes are unchanged (every step of a run), so its pages are allocated once.
Rewriting in place is safe because a sync is sequential: the engines have copied the previous
version into their own parameters before `WeightSync.push` returns, and the next write starts
after that. The write happens *before* the engines are paused (they keep generating meanwhile);
only the load happens inside the pause.

In-host only: an engine on another node cannot see this host's /dev/shm; use ``sync_mode:
distributed`` there (`palaestra.trainer.sglang_sync`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["SharedWeightsFile", "default_shm_root", "safetensors_dtype"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (raises for one safetensors cannot hold)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be written to safetensors") from None


def default_shm_root() -> Path:
    """/dev/shm where it exists (Linux), else the temp directory (still correct, not memory-backed)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is a contiguous CPU tensor (any dtype, bf16 too)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class SharedWeightsFile:
    """One ``model.safetensors`` under `root` (default /dev/shm), rewritten in place each sync."""

    def __init__(self, root: str | Path | None = None):
        base = Path(root) if root is not None else default_shm_root()
        self.directory = base / f"palaestra-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.directory.mkdir(parents=True, exist_ok=False)
        self.path = self.directory / "model.safetensors"
        self._header: bytes | None = None
        self._offsets: list[int] = []
        # shared memory outlives the process unless removed: also at garbage collection and exit
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def _layout(self, named: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, list[int]]:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offsets, position = [], 0
        for name, t in named:
            n = t.numel() * t.element_size()
            header[name] = {
                "dtype": safetensors_dtype(t.dtype),
                "shape": list(t.shape),
                "data_offsets": [position, position + n],
            }
            offsets.append(position)
            position += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        return len(raw).to_bytes(8, "little") + raw, offsets

    def write(self, named: Sequence[tuple[str, torch.Tensor]]) -> Path:
        """Writes `named` (HF names) into the file; returns the directory to hand to the engines."""
        if not named:
            raise ValueError("no tensors to write")
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the weight update")
        header, offsets = self._layout(named)
        if header != self._header:  # first write, or the layout changed: start a fresh file
            with open(self.path, "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(t.numel() * t.element_size() for _, t in named))
            self._header, self._offsets = header, offsets
        fd = os.open(self.path, os.O_WRONLY)
        try:
            base = len(header)
            for (_, t), offset in zip(named, self._offsets, strict=True):
                data = _raw_bytes(t)
                written = 0
                while written < len(data):  # pwrite may write less than asked for large buffers
                    written += os.pwrite(fd, data[written:], base + offset + written)
        finally:
            os.close(fd)
        return self.directory

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        self._cleanup()

    def __enter__(self) -> SharedWeightsFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
