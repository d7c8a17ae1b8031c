"""Checkpoints (resume training exactly) and HF export (what engines load).

A checkpoint directory::

    trainer_state.json     step, weight_version, the resolved TrainerConfig, model_dir, format
    model.pt               live actor weights of the whole model (gathered over TP), Megatron names
    optimizer_tp<t>.pt     Megatron optimizer state_dict of TP rank t (Adam moments, step counts);
                           optimizer_tp<t>_ep<e>.pt with expert parallelism (EP rank e's experts)
    old_actor.pt           the `old_actor` snapshot (whole model), when keep_old_actor is on
    rng/rank_<r>.pt        torch CPU (and CUDA) generators, Python's and NumPy's, per rank

With LoRA (``trainer.lora.rank`` > 0) the frozen base is not stored — it is `model_dir`'s, checked
by its checksum (``base_checksum`` in trainer_state.json; resuming onto another base is refused) —
and the adapters take the weights' place: ``adapter.pt`` (whole factors by PEFT name),
``old_adapter.pt`` (keep_old_actor), the optimizer files holding the adapters' moments.

The `ref` and `teacher` snapshots are not stored: they are read again from `model_dir` and
`opd.teacher_model`, which the saved config names. Writing goes to ``<dir>.tmp`` and is renamed into
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
    lora = trainer.lora
    group = trainer.tp()[0]
    if lora is not None:  # every tensor gathered over TP: a collective on every rank
        model = trainer.adapter_state()
        old_actor = lora.gather(lora.old_state(), group) if lora.has_old else None
    else:
        model = trainer.megatron_state()
        old_actor = (
            trainer.gather_model(trainer.snapshots.tensors("old_actor"))
            if "old_actor" in trainer.snapshots.tags
            else None
        )
    names = ("adapter.pt", "old_adapter.pt") if lora is not None else ("model.pt", "old_actor.pt")
    # DP replicas hold the same optimizer state; with expert parallelism each EP rank holds the
    # moments of its own experts, so the first replica of every (TP, EP) position writes a file.
    if parallel_state.get_expert_data_parallel_rank() == 0:
        torch.save(trainer.optimizer.state_dict(), tmp / _optimizer_file())
    if rank == 0:
        torch.save({k: v.cpu().clone() for k, v in model.items()}, tmp / names[0])
        if old_actor is not None:
            torch.save({k: v.cpu().clone() for k, v in old_actor.items()}, tmp / names[1])
        state = {
            "format": FORMAT,
            "step": trainer.step_count,
            "weight_version": trainer.weight_version,
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "model_dir": str(trainer.model_dir),
            "config": trainer.config.to_dict(),
            "base_checksum": trainer.base_checksum,
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
    if trainer.lora is not None:
        _load_adapters(trainer, path, state)
    else:
        if not (path / "model.pt").is_file():
            raise ValueError(
                f"{path} holds LoRA adapters (adapter.pt), this trainer trains the full model: set "
                f"trainer.lora as the checkpoint's config has it ({state['config'].get('lora')})"
            )
        trainer.load_megatron_state(torch.load(path / "model.pt", weights_only=True))
        trainer.snapshots.mark_live_changed()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if state.get("expert_model_parallel_size", 1) != ep:
        raise ValueError(
            f"{path} was written with expert_model_parallel_size {state.get('expert_model_parallel_size', 1)}, "
            f"this trainer has {ep}: the optimizer state is per EP rank's experts"
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if state.get("pipeline_model_parallel_size", 1) != pp:
        raise ValueError(
            f"{path} was written with pipeline_model_parallel_size {state.get('pipeline_model_parallel_size', 1)}, "
            f"this trainer has {pp}: the optimizer state is per pipeline stage"
        )
    trainer.optimizer.load_state_dict(torch.load(path / _optimizer_file(), weights_only=True))
    if (path / "old_actor.pt").is_file() and "old_actor" in trainer.snapshots.tags:
        full = torch.load(path / "old_actor.pt", weights_only=True)
        trainer.snapshots.load("old_actor", trainer.shard_model(full))
    rng = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng.is_file():
        # our own file: Python's and NumPy's generator states are not plain tensors
        _set_rng_state(torch.load(rng, weights_only=False))
    trainer.step_count = int(state["step"])
    trainer.weight_version = int(state["weight_version"])


def _optimizer_file() -> str:
    """This rank's optimizer file: optimizer_tp<t>.pt, or optimizer_tp<t>_ep<e>.pt with EP > 1."""
    from megatron.core import parallel_state

    name = f"optimizer_tp{parallel_state.get_tensor_model_parallel_rank()}"
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_ep{parallel_state.get_expert_model_parallel_rank()}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_pp{parallel_state.get_pipeline_model_parallel_rank()}"
    return name + ".pt"


def _load_adapters(trainer: Trainer, path: Path, state: dict) -> None:
    """The LoRA part of `load`: the base checked by checksum, the adapters (and old ones) in."""
    lora = trainer.lora
    assert lora is not None
    if not (path / "adapter.pt").is_file():
        raise ValueError(
            f"{path} holds the full model's weights (model.pt), not LoRA adapters: resume it with "
            "trainer.lora.rank: 0, or start the LoRA run afresh"
        )
    if state.get("base_checksum") != trainer.base_checksum:
        raise ValueError(
            f"{path}'s adapters were trained on another base model (base checksum "
            f"{state.get('base_checksum')}, {state.get('model_dir')}); this trainer's base "
            f"{trainer.model_dir} has checksum {trainer.base_checksum}"
        )
    lora.load_local(lora.shard(torch.load(path / "adapter.pt", weights_only=True)))
    if (path / "old_adapter.pt").is_file() and trainer.config.keep_old_actor:
        lora.set_old(lora.shard(torch.load(path / "old_adapter.pt", weights_only=True)))


def export_hf(trainer: Trainer, path: Path) -> Path:
    from palaestra.weights_format import save_safetensors

    hf = trainer.hf_state(merged=True)  # every rank takes part (a collective over TP)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("*.safetensors"):
            old.unlink()
        save_safetensors(
            {k: v.contiguous() for k, v in hf.items()}, path / "model.safetensors", {"format": "pt"}
        )
        skip = {"model.safetensors.index.json", "palaestra_preset.json"}
        for f in Path(trainer.model_dir).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
                shutil.copy2(f, path / f.name)
    _barrier()
    return path
