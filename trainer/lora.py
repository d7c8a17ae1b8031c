"""LoRA adapters on the Megatron model: y = W·x + (α/r)·B·A·dropout(x), the base weights frozen.

`inject(gpt, arch, options)` (before Megatron's DDP wraps the model, so that DDP's gradient buffers
and the optimizer hold the adapters only) gives every targeted projection its own pair of factors
A [r, in] and B [out, r], B zero at the start (the adapted model is the base model until the
first step), A Kaiming-uniform as PEFT draws it. Targets are HF projection names, the ones PEFT
and SGLang use: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` (``all`` = every one;
Megatron's module names ``linear_qkv linear_proj linear_fc1 linear_fc2`` stand for the
projections they fuse). Each HF projection keeps its own factors even where Megatron fuses it
(q, k, v in ``linear_qkv``, gate and up in ``linear_fc1``): the delta of each is placed into the
fused output's layout, so the factors *are* PEFT's ``lora_A``/``lora_B`` of that projection and
export without any conversion.

Tensor parallelism: each factor is sharded or replicated the way its projection is.

==========================  ================  ==========================  ==========================
projections                 Megatron module   A [r, in]                   B [out, r]
==========================  ================  ==========================  ==========================
q_proj, k_proj, v_proj      linear_qkv        replicated (the input is    split along out, like W's
                            (column-parallel) whole on every rank)        rows (a rank's query
                                                                          groups; gate/up: its
gate_proj, up_proj          linear_fc1                                    slice of each half)
                            (column-parallel)
o_proj, down_proj           linear_proj,      split along in, like W's    replicated (the output is
                            linear_fc2        columns (the input is       whole after the
                            (row-parallel)    split)                      all-reduce)
==========================  ================  ==========================  ==========================

Column-parallel: u = A·x is the same on every rank; ``copy_to_tensor_model_parallel_region(u)``
(identity forward, all-reduce backward) sums each rank's B-slice share of ∂u, so A's gradient is
whole and the same everywhere. Row-parallel: each rank's A-slice gives a partial u, summed by
``reduce_from_tensor_model_parallel_region`` (all-reduce forward) before the replicated B. A
replicated factor is not marked ``tensor_model_parallel``, so Megatron's grad norm counts it once.
The factors are drawn whole from a generator seeded per projection and then cut, so every TP size
starts from the same adapter.

`Adapters` is what the trainer holds: the factors by HF projection, the switch that turns them off
(`disabled()`: the frozen base is the reference policy and needs no snapshot), an old copy for
one-step-off training (`old()`), and whole-model tensors in PEFT's names (`peft_state`) for
export, weight sync and checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from palaestra.trainer.convert import HFArchitecture

__all__ = [
    "ALIASES",
    "PROJECTIONS",
    "Adapters",
    "LoraOptions",
    "check_rank",
    "inject",
    "is_adapter_param",
    "projection_shapes",
    "resolve_targets",
]

PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of every supported architecture (Llama, Mistral, Qwen2, Qwen3), HF's names."""

ALIASES: dict[str, tuple[str, ...]] = {
    "all": PROJECTIONS,
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Target names that stand for several projections: ``all``, and Megatron's fused modules."""

# HF projection -> (Megatron module under decoder.layers.{i}, its parallel kind)
_MODULE: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "column"),
    "k_proj": ("self_attention.linear_qkv", "column"),
    "v_proj": ("self_attention.linear_qkv", "column"),
    "o_proj": ("self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.linear_fc1", "column"),
    "up_proj": ("mlp.linear_fc1", "column"),
    "down_proj": ("mlp.linear_fc2", "row"),
}
_HF_PARENT = {
    p: ("self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for p in PROJECTIONS
}
_ADAPTER_MARK = ".lora."  # in the Megatron name of every adapter parameter


@dataclass
class LoraOptions:
    """LoRA adapters instead of full fine-tuning (docs/trainer.md, "LoRA")."""

    rank: int = 0
    """r of every adapter; 0 = off (full fine-tuning). Must not exceed any targeted projection's
    smaller dimension."""

    alpha: float = 32.0
    """α: the adapter's output is scaled by α/r. 32 for every rank, as Tinker does: a higher rank
    then learns at the same pace per step without retuning lr."""

    dropout: float = 0.0
    """Dropout on the adapter's input while training. Anything above 0 makes the training pass's
    logprobs differ from the engine's (the PPO ratio is then not 1 at the start of a step)."""

    targets: list[str] = field(default_factory=lambda: ["all"])
    """Projections that get an adapter: HF names (q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj), ``all``, or Megatron's linear_qkv / linear_proj / linear_fc1 / linear_fc2."""

    name: str = "policy"
    """The adapter's name on the engines (SGLang's lora_name); the gateway names it in every call."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 1 (or 0 for full fine-tuning); got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be positive; got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1); got {self.dropout}")
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError(
                f"lora.name must be a non-empty name without '/', '\\' or spaces; got {self.name!r}"
            )
        resolve_targets(self.targets)  # the error lists the projections

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(targets: list[str]) -> tuple[str, ...]:
    """HF projection names, in `PROJECTIONS` order, of `targets`; a ValueError names a bad one
    and lists the model's projections."""
    if not targets:
        raise ValueError(f"lora.targets is empty; the projections are {', '.join(PROJECTIONS)} (or 'all')")
    chosen: set[str] = set()
    for t in targets:
        if t in PROJECTIONS:
            chosen.add(t)
        elif t in ALIASES:
            chosen.update(ALIASES[t])
        else:
            raise ValueError(
                f"lora.targets: {t!r} is not a projection of this model; its projections are "
                f"{', '.join(PROJECTIONS)} (also 'all', and Megatron's linear_qkv = q/k/v_proj, "
                "linear_proj = o_proj, linear_fc1 = gate/up_proj, linear_fc2 = down_proj)"
            )
    return tuple(p for p in PROJECTIONS if p in chosen)


def projection_shapes(arch: HFArchitecture) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection: the shape of its weight."""
    q, kv, h, ffn = (
        arch.num_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
        arch.hidden_size,
        arch.intermediate_size,
    )
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }


def check_rank(options: LoraOptions, arch: HFArchitecture) -> None:
    """A rank no targeted projection can hold (r > min(out, in)) is refused, naming the projection."""
    shapes = projection_shapes(arch)
    for p in resolve_targets(options.targets):
        out_dim, in_dim = shapes[p]
        if options.rank > min(out_dim, in_dim):
            raise ValueError(
                f"lora.rank {options.rank} is larger than {p}'s smaller dimension ({p} is "
                f"{out_dim} x {in_dim}): a rank-{options.rank} adapter cannot be low-rank there. Use "
                f"lora.rank <= {min(min(shapes[t]) for t in resolve_targets(options.targets))} or leave "
                f"{p} out of lora.targets"
            )


def is_adapter_param(name: str) -> bool:
    """True for the Megatron name of an adapter factor (`inject` puts them under ``.lora.``)."""
    return _ADAPTER_MARK in name


def _peft_name(layer: int, projection: str, factor: str) -> str:
    """PEFT's tensor name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return f"base_model.model.model.layers.{layer}.{_HF_PARENT[projection]}.{projection}.lora_{factor}.weight"


@dataclass
class Factor:
    """One factor of one projection on this rank: its parameter, whole shape, and TP split axis."""

    param: torch.nn.Parameter
    shape: tuple[int, int]  # whole (unsharded) shape
    axis: int | None  # the dimension split over TP ranks, None = replicated


class Branch(torch.nn.Module):
    """A and B of one HF projection (this rank's parts)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)


class _Group(torch.nn.ModuleDict):
    """The branches on one Megatron linear module, and the forward hook that adds their deltas."""

    def __init__(
        self,
        adapters: Adapters,
        kind: str,
        layout: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    ):
        super().__init__()
        self._adapters = [adapters]  # a list: not a submodule (no parameters of its own)
        self.kind = kind
        self.layout = layout

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        adapters = self._adapters[0]
        if not adapters.enabled:
            return output
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = args[0] if args else kwargs["input_"]
        out, bias = output
        p = adapters.options.dropout
        if p and module.training:
            x = F.dropout(x, p, training=True)
        deltas: dict[str, torch.Tensor] = {}
        for name, branch in self.items():
            u = F.linear(x, branch.lora_A)
            if self.kind == "column":
                u = copy_to_tensor_model_parallel_region(u)  # ∂u summed over the B slices
            else:
                u = reduce_from_tensor_model_parallel_region(u)  # the A slices' partial sums
            deltas[name] = F.linear(u, branch.lora_B)
        return out + adapters.scale * self.layout(deltas, out), bias


def _qkv_layout(arch: HFArchitecture, tp: int):
    """Deltas of q/k/v_proj (this rank's rows, HF order) into linear_qkv's fused layout: per query
    group its q heads, then its k head, then its v head (convert.py)."""
    groups, r, d = arch.num_kv_heads // tp, arch.heads_per_group, arch.head_dim
    sizes = {"q_proj": r * d, "k_proj": d, "v_proj": d}

    def layout(deltas: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        lead = out.shape[:-1]
        parts = [
            deltas[p].reshape(*lead, groups, n) if p in deltas else out.new_zeros(*lead, groups, n)
            for p, n in sizes.items()
        ]
        return torch.cat(parts, dim=-1).reshape(out.shape)

    return layout


def _fc1_layout(deltas: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Deltas of gate/up_proj into linear_fc1's layout: this rank's gate rows, then its up rows."""
    half = out.shape[-1] // 2
    return torch.cat(
        [deltas.get(p, out.new_zeros(*out.shape[:-1], half)) for p in ("gate_proj", "up_proj")], dim=-1
    )


def _single_layout(deltas: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    (delta,) = deltas.values()
    return delta


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class Adapters:
    """The adapters `inject` added: factors by projection, the on/off switch, PEFT-named tensors."""

    def __init__(self, options: LoraOptions, arch: HFArchitecture, tp_rank: int, tp_size: int):
        self.options = options
        self.arch = arch
        self.scale = options.scale
        self.targets = resolve_targets(options.targets)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.enabled = True
        self.factors: dict[str, Factor] = {}  # PEFT name -> this rank's factor
        self._hooks: list[Any] = []
        self._old: dict[str, torch.Tensor] | None = None

    # -- the switch ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The frozen base model (the adapters add nothing) for the duration."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def parameters(self) -> list[torch.nn.Parameter]:
        return [f.param for f in self.factors.values()]

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's factors."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # -- the previous step's adapters (one-step-off: the policy that sampled the batch) ---------
    @torch.no_grad()
    def save_old(self) -> None:
        """Keeps a copy of the factors as they are now (`old()` switches them in)."""
        self._old = {n: f.param.detach().clone() for n, f in self.factors.items()}

    @property
    def has_old(self) -> bool:
        return self._old is not None

    def old_state(self) -> dict[str, torch.Tensor]:
        assert self._old is not None, "save_old() first"
        return self._old

    def set_old(self, local: Mapping[str, torch.Tensor]) -> None:
        self._old = {n: local[n].clone() for n in self.factors}

    @contextlib.contextmanager
    def old(self) -> Iterator[None]:
        """The saved factors in place of the live ones for the duration (live ones restored after)."""
        if self._old is None:
            raise RuntimeError("no old adapter: save_old() runs after each step with keep_old_actor")
        with torch.no_grad():
            live = {n: f.param.detach().clone() for n, f in self.factors.items()}
            for n, f in self.factors.items():
                f.param.copy_(self._old[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, f in self.factors.items():
                    f.param.copy_(live[n])

    # -- whole tensors (PEFT names) --------------------------------------------------------------
    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's factors by PEFT name (detached)."""
        return {n: f.param.detach() for n, f in self.factors.items()}

    def gather(self, local: Mapping[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
        """Whole factors from every TP rank's parts (a collective over `group`)."""
        import torch.distributed as dist

        out: dict[str, torch.Tensor] = {}
        for n, f in self.factors.items():
            t = local[n].contiguous()
            if f.axis is None or self.tp_size == 1:
                out[n] = t
                continue
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(parts, t, group=group)
            out[n] = torch.cat(parts, dim=f.axis)
        return out

    def shard(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's parts of whole factors (the inverse of `gather`); checks names and shapes."""
        missing, extra = sorted(set(self.factors) - set(full)), sorted(set(full) - set(self.factors))
        if missing or extra:
            raise KeyError(f"LoRA adapter tensors: missing {missing[:4]}, unexpected {extra[:4]}")
        out = {}
        for n, f in self.factors.items():
            t = full[n]
            if tuple(t.shape) != f.shape:
                raise ValueError(f"{n}: the adapter has {tuple(t.shape)}, this model needs {f.shape}")
            out[n] = t if f.axis is None else t.chunk(self.tp_size, dim=f.axis)[self.tp_rank].contiguous()
        return out

    @torch.no_grad()
    def load_local(self, local: Mapping[str, torch.Tensor]) -> None:
        for n, f in self.factors.items():
            f.param.copy_(local[n])

    def peft_config(self, base_model: str) -> dict[str, Any]:
        """PEFT's adapter_config.json for these adapters (`peft.LoraConfig` reads it)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.options.rank,
            "lora_alpha": self.options.alpha,
            "lora_dropout": self.options.dropout,
            "target_modules": list(self.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
            "modules_to_save": None,
        }


def _fold_frozen_dgrad() -> None:
    """Megatron's linear with a frozen weight computes its input gradient as
    ``grad_output.matmul(weight)``. The output layer's grad_output is [s, b, vocab] with b's stride
    the largest (a transpose of [b, s, vocab]), which torch.matmul cannot fold into one matrix
    product: it runs a batched product with the weight expanded s times, the slowest op of a LoRA
    step (tiny, 1368 tokens: 1.3 s of a 2-5 s step; full fine-tuning's path never meets it).
    (``.contiguous()`` does not help: a size-1 dimension's stride does not count for it, but does
    for matmul's folding.) Viewed as [s·b, vocab] it is one mm. Installed once; the same numbers up
    to summation order."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    if getattr(LinearWithFrozenWeight, "_palaestra_folded", False):
        return
    backward = LinearWithFrozenWeight.backward

    def folded(ctx, grad_output):
        lead = grad_output.shape[:-1]
        grad_input, *rest = backward(ctx, grad_output.reshape(-1, grad_output.shape[-1]))
        return (grad_input.reshape(*lead, grad_input.shape[-1]), *rest)

    LinearWithFrozenWeight.backward = staticmethod(folded)
    LinearWithFrozenWeight._palaestra_folded = True


def inject(gpt: torch.nn.Module, arch: HFArchitecture, options: LoraOptions, seed: int) -> Adapters:
    """Adds the adapters to `gpt` (a `GPTModel` of this pipeline stage, before DDP wraps it) and
    freezes every other parameter. Returns the `Adapters`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    check_rank(options, arch)
    _fold_frozen_dgrad()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    adapters = Adapters(options, arch, tp_rank, tp)
    for p in gpt.parameters():
        p.requires_grad_(False)
    shapes = projection_shapes(arch)
    dtype = next(gpt.parameters()).dtype
    device = next(gpt.parameters()).device
    layouts = {"self_attention.linear_qkv": _qkv_layout(arch, tp), "mlp.linear_fc1": _fc1_layout}
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1  # global layer index (pipeline stages hold a slice)
        groups: dict[str, _Group] = {}
        for projection in adapters.targets:
            path, kind = _MODULE[projection]
            module = layer.get_submodule(path)
            if path not in groups:
                groups[path] = _Group(adapters, kind, layouts.get(path, _single_layout))
            out_dim, in_dim = shapes[projection]
            r = options.rank
            a = torch.empty(r, in_dim)
            # PEFT's init of lora_A: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(in_dim)
            a.uniform_(-bound, bound, generator=_generator(seed, _peft_name(index, projection, "A")))
            b = torch.zeros(out_dim, r)
            a_axis, b_axis = (None, 0) if kind == "column" else (1, None)
            if tp > 1:
                if a_axis is not None:
                    a = a.chunk(tp, dim=a_axis)[tp_rank]
                if b_axis is not None:
                    b = b.chunk(tp, dim=b_axis)[tp_rank]
            branch = Branch(
                a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous()
            )
            for param, axis in ((branch.lora_A, a_axis), (branch.lora_B, b_axis)):
                set_tensor_model_parallel_attributes(param, axis is not None, axis or 0, 1)
            groups[path][projection] = branch
            adapters.factors[_peft_name(index, projection, "A")] = Factor(branch.lora_A, (r, in_dim), a_axis)
            adapters.factors[_peft_name(index, projection, "B")] = Factor(branch.lora_B, (out_dim, r), b_axis)
        for path, group in groups.items():
            module = layer.get_submodule(path)
            module.lora = group  # parameters named ...<path>.lora.<projection>.lora_A (is_adapter_param)
            adapters._hooks.append(module.register_forward_hook(group.hook, with_kwargs=True))
    return adapters
