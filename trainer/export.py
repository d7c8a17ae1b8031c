"""Exports users load elsewhere: the LoRA adapter in PEFT's layout, and merged HF checkpoints.

    palaestra export runs/demo                       # the latest checkpoint of a run
    palaestra export runs/demo/checkpoints/step-50 --out adapter/
    palaestra export runs/demo --merged --out merged/

From a checkpoint (no Megatron, no model built: the files are converted):

* a LoRA run's checkpoint (``adapter.pt``): by default its adapter as a PEFT directory
  (``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained``
  and SGLang's ``/load_lora_adapter`` read; with ``--merged`` an HF model directory of the base
  with the adapter folded in, W + (α/r)·B·A per projection;
* a full fine-tuning checkpoint (``model.pt``): the HF model directory (``--merged`` or not).

Every file is mode 0644; the adapter's ``base_model_name_or_path`` is the preset's name (``tiny``,
``demo-student``) for a built preset, else the model directory given (`models.cache.model_name`).

An HF directory holds ``model.safetensors`` plus the base model's config, generation config and
tokenizer files, so `from_pretrained` and `palaestra engine serve --model DIR` read it. The
adapter's safetensors metadata carries the base model's checksum (`weights_format.base_checksum`):
the embedded engine refuses it on another base.

`export_adapter(trainer, dir)` is the same PEFT directory from a live trainer (`Trainer.export_adapter`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from palaestra.trainer.trainer import Trainer

__all__ = ["export_adapter", "export_checkpoint", "merge_into", "register"]


def merge_into(
    hf: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """`hf` (HF-named weights) with each PEFT factor pair of `adapter` folded in: W + scale·B·A."""
    out = dict(hf)
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    for name, a in adapter.items():
        if not name.endswith(suffix):
            continue
        module = name[len(prefix) : -len(suffix)]
        b = adapter[f"{prefix}{module}.lora_B.weight"]
        weight = out[f"{module}.weight"]
        delta = (b.double() @ a.double()) * scale  # in float64, rounded once into the weight's dtype
        out[f"{module}.weight"] = (weight.double() + delta).to(weight.dtype)
    return out


def export_adapter(trainer: Trainer, path: Path) -> Path:
    """The trainer's adapters as a PEFT directory at `path` (every rank calls; rank 0 writes)."""
    import torch.distributed as dist

    from palaestra.models.cache import model_name
    from palaestra.weights_format import write_adapter

    if trainer.lora is None:
        raise ValueError("export_adapter needs trainer.lora (rank > 0); export_hf writes the full model")
    tensors = trainer.adapter_state()  # a collective over TP
    if dist.get_rank() == 0:
        write_adapter(
            path, trainer.lora.peft_config(model_name(trainer.model_dir)), tensors, trainer.base_checksum
        )
    if dist.get_world_size() > 1:
        dist.barrier()
    return path


def _checkpoint_dir(path: Path) -> Path:
    """The trainer checkpoint directory behind `path`: itself, a run checkpoint's ``trainer/``, or
    a run directory's latest checkpoint."""
    for candidate in (path, path / "trainer"):
        if (candidate / "trainer_state.json").is_file():
            return candidate
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        return _checkpoint_dir(path / "checkpoints" / latest.read_text().strip())
    raise FileNotFoundError(
        f"{path} is not a checkpoint: give a run directory (runs/<name>), one of its checkpoints "
        "(runs/<name>/checkpoints/step-N) or a trainer checkpoint (with trainer_state.json)"
    )


def _copy_model_files(model_dir: Path, out: Path) -> None:
    skip = {"model.safetensors.index.json", "palaestra_preset.json"}
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, out / f.name)


def export_checkpoint(checkpoint: str | Path, out: str | Path, merged: bool = False) -> Path:
    """Writes the export of `checkpoint` (module docstring) to `out`; returns `out`."""
    from transformers import AutoConfig

    from palaestra.models.cache import model_name
    from palaestra.trainer.config import TrainerConfig
    from palaestra.trainer.convert import HFArchitecture, megatron_to_hf
    from palaestra.trainer.lora import Adapters, LoraOptions
    from palaestra.weights_format import base_checksum, read_safetensors, save_safetensors, write_adapter

    ckpt = _checkpoint_dir(Path(checkpoint))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    model_dir = Path(state["model_dir"])
    config = TrainerConfig.from_dict(state["config"])
    out = Path(out)
    if (ckpt / "adapter.pt").is_file():
        adapter = torch.load(ckpt / "adapter.pt", weights_only=True)
        arch = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(model_dir))
        options: LoraOptions = config.lora
        peft_config = Adapters(options, arch, 0, 1).peft_config(model_name(model_dir))
        if not merged:
            return write_adapter(out, peft_config, adapter, state.get("base_checksum"))
        base = dict(read_safetensors(model_dir))
        if state.get("base_checksum") and base_checksum(base.items()) != state["base_checksum"]:
            raise ValueError(
                f"{model_dir} no longer holds the base model {ckpt} was trained on (its checksum "
                f"changed): cannot merge the adapter into it"
            )
        base = {k: v.float() for k, v in base.items()}  # the trainer's dtype
        hf = merge_into(base, adapter, options.scale)
    else:
        hf = megatron_to_hf(torch.load(ckpt / "model.pt", weights_only=True), _arch(model_dir))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_safetensors({k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors", {"format": "pt"})
    _copy_model_files(model_dir, out)
    return out


def _arch(model_dir: Path):
    from transformers import AutoConfig

    from palaestra.trainer.convert import HFArchitecture

    return HFArchitecture.from_hf_config(AutoConfig.from_pretrained(model_dir))


def _command(args: argparse.Namespace) -> int:
    try:
        ckpt = _checkpoint_dir(Path(args.checkpoint))
        lora = (ckpt / "adapter.pt").is_file()
        out = args.out or str(ckpt.parent / ("adapter" if lora and not args.merged else "hf"))
        path = export_checkpoint(ckpt, out, merged=args.merged)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"palaestra export: {exc}", file=sys.stderr)
        return 1
    what = "PEFT adapter" if lora and not args.merged else ("merged HF model" if lora else "HF model")
    print(f"palaestra export: {what} of {ckpt} written to {path}")
    return 0


def register(groups) -> None:
    p = groups.add_parser(
        "export",
        help="export a checkpoint: a LoRA run's PEFT adapter, or an HF model (merged with --merged)",
        description="Writes what users load elsewhere from a trainer checkpoint: a LoRA run's adapter "
        "as a PEFT directory (adapter_config.json + adapter_model.safetensors, which peft and SGLang "
        "load), or with --merged the base model with the adapter folded in as an HF directory; a "
        "full fine-tuning checkpoint becomes an HF directory. No model is built: the files are "
        "converted. See docs/trainer.md.",
    )
    p.add_argument(
        "checkpoint",
        help="a run directory (its latest checkpoint), runs/<name>/checkpoints/step-N, or a trainer "
        "checkpoint directory",
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: adapter/ or hf/ next to the checkpoint)"
    )
    p.add_argument(
        "--merged", action="store_true", help="LoRA: write the base model with the adapter merged in (HF)"
    )
    p.set_defaults(func=_command)
