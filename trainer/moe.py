"""Mixture-of-experts mechanics of the trainer: parallel layout checks and router metrics.

* `check_layout` refuses, before any process group exists, a parallel layout that does not divide
  the model (experts over EP ranks, layers over PP stages, heads over TP ranks), naming the numbers.
* `RouterStats` watches every MoE router of the live model during a training pass: the tokens each
  expert received (``train/moe_load_imbalance``: the busiest expert's count over the mean, averaged
  over layers; 1.0 is perfectly even) and Megatron's own load-balancing / z-loss values when their
  coefficients are on (``train/moe_aux_loss``, ``train/moe_z_loss``, averaged over MoE layers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from palaestra.trainer.convert import HFArchitecture

__all__ = ["RouterStats", "check_layout"]


def check_layout(arch: HFArchitecture, megatron: dict[str, Any]) -> None:
    """Raises ValueError naming the numbers when the parallel sizes do not divide the model."""
    tp = int(megatron.get("tensor_model_parallel_size") or 1)
    pp = int(megatron.get("pipeline_model_parallel_size") or 1)
    ep = int(megatron.get("expert_model_parallel_size") or 1)
    etp = megatron.get("expert_tensor_parallel_size")
    problems = []
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        problems.append(
            f"{arch.num_heads} attention heads / {arch.num_kv_heads} KV heads do not divide over "
            f"tensor_model_parallel_size {tp}"
        )
    if arch.num_layers % pp:
        problems.append(f"{arch.num_layers} layers do not divide over pipeline_model_parallel_size {pp}")
    if ep > 1 and not arch.is_moe:
        problems.append(
            f"expert_model_parallel_size {ep} needs a mixture-of-experts model; this one is dense"
        )
    elif arch.is_moe and arch.num_experts % ep:
        problems.append(f"{arch.num_experts} experts do not divide over expert_model_parallel_size {ep}")
    if etp is not None and int(etp) != tp:
        problems.append(
            f"expert_tensor_parallel_size {etp} differs from tensor_model_parallel_size {tp}: the "
            "trainer's weight gathering assumes experts are split like the dense layers"
        )
    if problems:
        raise ValueError(f"parallel layout does not fit {arch.architecture}: " + "; ".join(problems))


class RouterStats:
    """Per-expert token counts of every MoE router during the passes inside ``with stats:``."""

    def __init__(self, gpt: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        self.counts: list[torch.Tensor] = [torch.zeros(0) for _ in self.routers]
        self._hooks: list[Any] = []

    def __enter__(self) -> RouterStats:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self.counts = [torch.zeros(r.config.num_moe_experts, dtype=torch.float64) for r in self.routers]
        for i, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i: int):
        def record(_module, _inputs, output):
            routing_map = output[1]  # [tokens, experts] bool: which experts each token went to
            self.counts[i] += routing_map.detach().sum(0).double().cpu()

        return record

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def metrics(self, group=None) -> dict[str, float]:
        """``train/moe_*`` over this step (counts summed over `group`, the data-parallel ranks)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        if not self.routers:
            return {}
        counts = torch.stack(self.counts)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        mean = counts.mean(1).clamp_min(1e-9)
        out = {
            "train/moe_load_imbalance": float((counts.max(1).values / mean).mean()),
            "train/moe_expert_share_max": float((counts / counts.sum(1, keepdim=True).clamp_min(1)).max()),
        }
        for name, key in (("load_balancing_loss", "aux"), ("z_loss", "z")):
            values = get_moe_layer_wise_logging_tracker().get(name, {}).get("values")
            if values is not None and values.numel():
                moe = values[values != 0]
                out[f"train/moe_{key}_loss"] = float(moe.mean()) if moe.numel() else 0.0
        return out
