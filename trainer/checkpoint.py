"""Checkpoints (resume training exactly) and HF export (what engines load).

A checkpoint directory::

    trainer_state.json     step, weight_version, the resolved TrainerConfig, model_dir, format
    model.pt               live actor weights of the whole model (gathered over TP), Megatron names
    optimizer_tp<t>.pt     Megatron optimizer state_dict of TP rank t (Adam moments, step counts)
    old_actor.pt           the `old_actor` snapshot (whole model), when keep_old_actor is on
    rng/rank_<r>.pt        torch CPU (and CUDA) generators, Python's and NumPy's, per rank

The `ref` and `teacher` snapshots are not stored: they are read again from `model_dir` and
`teacher_model`, which the saved config names. Writing goes to ``<dir>.tmp`` and is renamed into
place once every rank has written, so a crash never leaves a half checkpoint under the real name.

`export_hf` writes ``model.safetensors`` with HF names plus the model directory's config,
generation config and tokenizer files: `from_pretrained`, `palaestra engine serve --model DIR`
and ``/update_weights_from_disk`` all read it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from palaestra.trainer.trainer import Trainer

__all__ = ["FORMAT", "export_hf", "load", "save"]

FORMAT = "palaestra-trainer-checkpoint/1"


def _rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(trainer: Trainer, path: Path) -> None:
    """Writes a checkpoint; every rank must call it (weights are gathered over TP)."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    if trainer.snapshots.live != "actor":
        raise RuntimeError(f"saving while {trainer.snapshots.live!r} is live")
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    model = trainer.megatron_state()
    old_actor = (
        trainer.gather_tp(trainer.snapshots.tensors("old_actor"))
        if "old_actor" in trainer.snapshots.tags
        else None
    )
    if parallel_state.get_data_parallel_rank() == 0:  # DP replicas hold the same optimizer state
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        torch.save(trainer.optimizer.state_dict(), tmp / f"optimizer_tp{tp_rank}.pt")
    if rank == 0:
        torch.save({k: v.cpu().clone() for k, v in model.items()}, tmp / "model.pt")
        if old_actor is not None:
            torch.save({k: v.cpu().clone() for k, v in old_actor.items()}, tmp / "old_actor.pt")
        state = {
            "format": FORMAT,
            "step": trainer.step_count,
            "weight_version": trainer.weight_version,
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "model_dir": str(trainer.model_dir),
            "config": trainer.config.to_dict(),
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    _barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    _barrier()


def load(trainer: Trainer, path: Path) -> None:
    """Resumes from `save`'s output: same TP size for the optimizer state; weights reshard freely."""
    from megatron.core import parallel_state

    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (format {state.get('format')!r})")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if state["tensor_model_parallel_size"] != tp:
        raise ValueError(
            f"{path} was written with tensor_model_parallel_size {state['tensor_model_parallel_size']}, "
            f"this trainer has {tp}: the optimizer state is per TP shard"
        )
    trainer.snapshots.switch("actor")
    trainer.load_megatron_state(torch.load(path / "model.pt", weights_only=True))
    trainer.snapshots.mark_live_changed()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    trainer.optimizer.load_state_dict(torch.load(path / f"optimizer_tp{tp_rank}.pt", weights_only=True))
    if (path / "old_actor.pt").is_file() and "old_actor" in trainer.snapshots.tags:
        full = torch.load(path / "old_actor.pt", weights_only=True)
        trainer.snapshots.load("old_actor", trainer.shard_tp(full))
    rng = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng.is_file():
        # our own file: Python's and NumPy's generator states are not plain tensors
        _set_rng_state(torch.load(rng, weights_only=False))
    trainer.step_count = int(state["step"])
    trainer.weight_version = int(state["weight_version"])


def export_hf(trainer: Trainer, path: Path) -> Path:
    from safetensors.torch import save_file

    hf = trainer.hf_state()  # every rank takes part (a collective once TP/PP gather exists)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("*.safetensors"):
            old.unlink()
        save_file(
            {k: v.contiguous() for k, v in hf.items()},
            str(path / "model.safetensors"),
            metadata={"format": "pt"},
        )
        skip = {"model.safetensors.index.json", "palaestra_preset.json"}
        for f in Path(trainer.model_dir).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
                shutil.copy2(f, path / f.name)
    _barrier()
    return path
