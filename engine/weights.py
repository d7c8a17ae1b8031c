"""Weight payloads for `/update_weights_from_disk` and `/update_weights_from_tensor`.

Disk: a directory (or one file) of safetensors with HF parameter names, as `save_pretrained` writes.

Tensor (in-host): `serialized_named_tensors` is a list of base64 strings, one per TP rank (the
embedded engine has one rank, so exactly one string). Each string is the base64 of a `torch.save`
archive of either

* a list of `(name, tensor)` pairs (`load_format` null or `"direct"`), or
* for `load_format: "flattened_bucket"`, a dict `{"flattened_tensor": 1-D tensor, "metadata":
  [{"name", "shape", "dtype", "start_idx", "end_idx", "numel"}, ...]}` — SGLang's bucket layout.

SGLang itself pickles CUDA IPC handles here (zero-copy between processes on one GPU); a CPU engine
has no such handles, so it takes the bytes. Reading uses `torch.load(weights_only=True)`: a payload
cannot run code.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from safetensors.torch import load_file

from palaestra.engine.protocol import RequestError


def read_safetensors(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise RequestError(f"no *.safetensors files in {p}")
    elif p.is_file():
        files = [p]
    else:
        raise RequestError(f"model_path {str(p)!r} does not exist")
    named: list[tuple[str, torch.Tensor]] = []
    for f in files:
        try:
            named.extend(load_file(str(f)).items())
        except Exception as exc:  # corrupt/unsafe file: a client error, not a crash
            raise RequestError(f"cannot read {f}: {exc}") from None
    return named


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], flattened: bool = False) -> str:
    """Encodes tensors the way `/update_weights_from_tensor` expects them (one rank)."""
    buf = io.BytesIO()
    if flattened:
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
            flats.append(flat.to(torch.float32) if flat.dtype != torch.float32 else flat)
            offset += flat.numel()
        torch.save({"flattened_tensor": torch.cat(flats), "metadata": metadata}, buf)
    else:
        torch.save([(name, t.detach().contiguous()) for name, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: list[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, list) or len(payload) != 1 or not isinstance(payload[0], str):
        raise RequestError("serialized_named_tensors must be a list with one base64 string (tp_size is 1)")
    try:
        obj = torch.load(io.BytesIO(base64.b64decode(payload[0], validate=True)), weights_only=True)
    except Exception as exc:
        raise RequestError(f"cannot decode serialized_named_tensors: {exc}") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise RequestError(
                "flattened_bucket payload must be {'flattened_tensor': ..., 'metadata': [...]}"
            )
        flat = obj["flattened_tensor"]
        out = []
        for m in obj["metadata"]:
            dtype = getattr(torch, m.get("dtype", "float32"))
            out.append((m["name"], flat[m["start_idx"] : m["end_idx"]].reshape(m["shape"]).to(dtype)))
        return out
    if load_format not in (None, "direct"):
        raise RequestError(
            f"load_format {load_format!r} is not supported (null, 'direct', 'flattened_bucket')"
        )
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(x, (list, tuple))
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], torch.Tensor)
        for x in obj
    ):
        raise RequestError("payload must be a list of (name, tensor) pairs")
    return [(name, t) for name, t in obj]
