"""Mixture-of-experts mechanics of the trainer: parallel layout checks and router metrics.

* `check_layout` refuses, before any process group exists, a parallel layout that does not divide
  the model (experts over EP ranks, layers over PP stages, heads over TP ranks), naming the numbers.
* `RouterStats` watches every MoE router of the live model during a training pass: the tokens each
  expert received (``train/moe_load_imbalance``: the busiest expert's count over the mean, averaged
  over layers; 1.0 is perfectly even) and Megatron's own load-balancing / z-loss values when their
  coefficients are on (``train/moe_aux_loss``, ``train/moe_z_loss``, averaged over MoE layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from palaestra.trainer.convert import HFArchitecture

__all__ = ["RouterStats", "RoutingReplay", "check_layout", "rollout_routing", "routing_problem"]


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
    if arch.is_moe and tp > 1:
        problems.append(
            f"tensor_model_parallel_size {tp} on a mixture-of-experts model: megatron-core's MoE layer "
            "trains under tensor parallelism only with sequence_parallel, which the trainer's local "
            "layer spec (torch LayerNorm) does not support; split the experts with "
            "expert_model_parallel_size and the layers with pipeline_model_parallel_size instead"
        )
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


# -- routing replay -------------------------------------------------------------------------------
# Megatron's routers built with moe_enable_routing_replay each own a `RouterReplay`
# (megatron.core.transformer.moe.router_replay): RECORD keeps the top-k indices the router chose,
# REPLAY_FORWARD takes given indices instead of choosing (the weights are still the router's own
# scores of those experts, so the router keeps its gradient). The trainer drives its own model's
# instances, not the class-wide list: several models may live in one process.
def routing_problem(sample: Any, arch: HFArchitecture) -> str | None:
    """Why `sample.routing()` cannot be replayed on `arch` (None: it can)."""
    import numpy as np

    routed = sample.routing()
    if routed is None:
        return "no routed_experts (the engine did not report its routing)"
    n = len(sample.tokens)
    # a token at position p is predicted from positions 0..p-1: the rows must reach the last
    # trained token's position (Sample checks this too); rows past them may be missing
    need = sample.prompt_len + max((i for i, m in enumerate(sample.loss_mask) if m), default=-1)
    layers = (len(arch.moe_layers), arch.num_layers)
    if (
        routed.ndim != 3
        or not max(need, 0) <= routed.shape[0] <= n
        or routed.shape[1] not in layers
        or routed.shape[2] != arch.moe_topk
    ):
        return (
            f"routed_experts has shape {tuple(routed.shape)}; this model needs ({max(need, 0)} to {n} "
            f"rows, {layers[0]} MoE layers or all {layers[1]} layers, top_k {arch.moe_topk})"
        )
    if routed.shape[1] == arch.num_layers:  # the engine's layout: dense layers' rows are filler
        routed = routed[:, list(arch.moe_layers)]
    if routed.min() < 0 or routed.max() >= arch.num_experts:
        return f"routed_experts holds ids outside 0..{arch.num_experts - 1}"
    if (np.sort(routed, -1)[..., 1:] == np.sort(routed, -1)[..., :-1]).any():
        return "routed_experts names an expert twice for one token"
    return None


def rollout_routing(
    samples: list[Any], sample_indices: list[int], arch: HFArchitecture
) -> list[torch.Tensor]:
    """Per MoE layer, [T, top_k] expert ids of a micro-batch's packed tokens, from its samples'
    `routing()` (checked by `routing_problem`; rows for every layer, as the engine sends them,
    keep the MoE layers'). Missing last rows (engines do not run the final sampled token, nor
    tokens appended after the last call) are filled with experts 0..k-1: causal attention keeps
    those positions' outputs out of every trained logprob."""
    rows = []
    for i in sample_indices:
        routed = torch.as_tensor(samples[i].routing()).long()
        if routed.shape[1] == arch.num_layers:  # the engine's layout, a row for every layer
            routed = routed[:, list(arch.moe_layers)]
        missing = len(samples[i].tokens) - routed.shape[0]
        if missing > 0:
            filler = torch.arange(arch.moe_topk).expand(missing, routed.shape[1], -1)
            routed = torch.cat([routed, filler])
        rows.append(routed)
    packed = torch.cat(rows)  # [T, MoE layers, top_k]
    return [packed[:, layer].contiguous() for layer in range(packed.shape[1])]


class RoutingReplay:
    """Records or replays the routing of this model's MoE routers, one micro-batch at a time."""

    def __init__(self, gpt: torch.nn.Module, own: Sequence[int] | None = None, total: int | None = None):
        """`own`: which of the whole model's `total` MoE layers this model's routers are, in order
        (a pipeline stage holds some of them); default: all of them."""
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        if any(r.router_replay is None for r in routers):
            raise RuntimeError("the routers were built without moe_enable_routing_replay")
        self.replays = [r.router_replay for r in routers]
        self.own = list(range(len(routers)) if own is None else own)
        self.total = len(routers) if total is None else total
        if len(self.own) != len(self.replays):
            raise ValueError(f"{len(self.replays)} routers for MoE layers {self.own}")
        self.mode: str | None = None  # None | "record" | "replay"

    def _set(self, action) -> None:
        for r in self.replays:
            r.clear_indices()
            if action is None:
                r.clear_router_replay_action()
            else:
                r.set_router_replay_action(action)

    @contextlib.contextmanager
    def active(self, mode: str):
        """Within: "record" stores each micro-batch's routing in `mb.routing`; "replay" routes each
        micro-batch with a `routing` by it (one without routes itself)."""
        self.mode = mode
        try:
            yield self
        finally:
            self.mode = None
            self._set(None)

    def before_forward(self, mb: Any) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.mode == "record":
            self._set(RouterReplayAction.RECORD)
        elif self.mode == "replay" and mb.routing is not None:
            routing = mb.routing  # the whole model's MoE layers (r3), or this model's own (r2's record)
            if len(routing) == self.total:
                routing = [routing[j] for j in self.own]
            elif len(routing) != len(self.replays):
                raise ValueError(
                    f"routing for {len(routing)} MoE layers; the model has {self.total} "
                    f"({len(self.replays)} here)"
                )
            self._set(RouterReplayAction.REPLAY_FORWARD)
            # REPLAY_FORWARD reads the target in the forward pass only (activation recompute, which
            # would read it again in the backward, is refused with routing replay under pipeline
            # parallelism, where 1F1B runs other micro-batches' forwards in between).
            for r, ids in zip(self.replays, routing, strict=True):
                r.set_target_indices(ids)
        else:
            self._set(None)

    def after_forward(self, mb: Any) -> None:
        if self.mode == "record":
            mb.routing = [r.get_recorded_indices().detach().cpu() for r in self.replays]
