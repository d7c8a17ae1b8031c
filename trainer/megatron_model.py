"""The Megatron side of the trainer: process groups, `TransformerConfig` and `GPTModel`.

* `init_parallel` starts torch.distributed (nccl on GPU, gloo on CPU; a single process needs no
  rendezvous) and Megatron's model-parallel groups. Parallel sizes are read from the trainer's
  ``megatron`` dict under Megatron's own names (`PARALLEL_KEYS`).
* `transformer_config` derives a `TransformerConfig` from the HF config (GQA, RMSNorm, SwiGLU,
  RoPE base, QKV bias, QK-norm) and applies the ``megatron`` dict on top, field by field.
* `build_model` builds `GPTModel` with Megatron's local layer spec (`get_gpt_layer_local_spec`),
  with core attention replaced by `PackedCausalAttention` so packed (THD) micro-batches work
  without TransformerEngine, and wraps it in Megatron's `DistributedDataParallel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from palaestra.rendezvous import is_loopback, store_address, tcp_store
from palaestra.trainer import cpu_shim
from palaestra.trainer.convert import HFArchitecture

__all__ = [
    "PARALLEL_KEYS",
    "build_model",
    "init_parallel",
    "layer_spec",
    "quiet_megatron_deprecations",
    "transformer_config",
    "unwrap",
]

# TransformerConfig fields that are also `initialize_model_parallel` arguments (same names).
PARALLEL_KEYS: tuple[str, ...] = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)

# Architecture facts come from the HF config; a `megatron` override may not contradict them,
# or the HF <-> Megatron conversion would silently mean something else.
_ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "gated_linear_unit",
    "add_qkv_bias",
    "add_bias_linear",
    "qk_layernorm",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_layer_freq",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
)


def init_parallel(
    megatron: dict[str, Any], init_method: str | None = None, timeout_minutes: int = 30
) -> None:
    """Starts torch.distributed and Megatron's parallel groups (idempotent for the same sizes).

    Multi-process runs set RANK and WORLD_SIZE (torchrun, Ray) and rendezvous through
    `init_method` (default ``env://``: MASTER_ADDR/MASTER_PORT; ``file://PATH`` needs no socket);
    rank 0's store listens on MASTER_ADDR only (palaestra/rendezvous.py), and on a loopback
    MASTER_ADDR gloo's sockets stay on loopback too.
    Without RANK/WORLD_SIZE this is one process with an in-memory store: nothing listens for a
    rendezvous, and gloo's own sockets stay on the loopback interface. Calling it again with the
    same parallel sizes is a no-op; different sizes raise, because Megatron's groups are
    process-wide.
    """
    cpu_shim.install()
    cpu_shim.check_supported(megatron)
    from megatron.core import parallel_state

    if megatron.get("virtual_pipeline_model_parallel_size"):
        raise ValueError("virtual pipeline stages (model chunks) are not supported by this trainer")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            address = store_address(init_method)
            if address is None:  # file:// (no socket), torchrun's agent store
                dist.init_process_group(
                    backend,
                    init_method=init_method or "env://",
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
            else:
                # torch's own env:// / tcp:// store would listen on every interface (palaestra/rendezvous.py)
                if is_loopback(address[0]) and backend == "gloo" and Path("/sys/class/net/lo").exists():
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets too
                store = tcp_store(*address, rank, world_size, timeout)
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore("default_pg", store),  # the keys torch's rendezvous uses
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
        else:
            if backend == "gloo" and Path("/sys/class/net/lo").exists():
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    sizes = {k: int(megatron[k]) for k in PARALLEL_KEYS if megatron.get(k) is not None}
    if parallel_state.model_parallel_is_initialized():
        current = {
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": parallel_state.get_context_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        }
        wanted = {k: sizes.get(k, 1) for k in current}
        if wanted != current:
            raise RuntimeError(
                f"Megatron's parallel groups already exist with {current}; this trainer wants {wanted}. "
                "Parallel state is per process: run differently-sharded trainers in separate processes."
            )
        return
    parallel_state.initialize_model_parallel(**sizes, distributed_timeout_minutes=timeout_minutes)


def transformer_config(arch: HFArchitecture, megatron: dict[str, Any]):
    """`TransformerConfig` for the HF architecture, with the ``megatron`` dict applied on top."""
    cpu_shim.import_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    derived: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        # RL needs the exact policy that sampled the tokens: no dropout.
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32,
        # The fused kernels below come from Apex/TransformerEngine, which a CPU box does not have.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "use_cpu_initialization": not torch.cuda.is_available(),
        # Micro-batch losses are sums with a denominator; Megatron divides the gradients by the
        # denominators' total over micro-batches and DP ranks (objective.py).
        "calculate_per_token_loss": True,
        **_moe_config(arch),
    }
    if int(megatron.get("pipeline_model_parallel_size") or 1) > 1:
        # Packed micro-batches differ in length: stages exchange each activation's shape first.
        # Megatron allows that only with the all-to-all dispatcher, even for a dense model.
        # gloo has no batched p2p: one isend/irecv at a time.
        derived.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", batch_p2p_comm=False)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(megatron) - fields)
    if unknown:
        raise ValueError(f"not TransformerConfig fields: {unknown}")
    for key in _ARCH_FIELDS:
        if key in megatron and megatron[key] != derived.get(key):
            raise ValueError(
                f"megatron[{key!r}]={megatron[key]!r} contradicts the HF config ({derived[key]!r})"
            )
    kwargs = {**derived, **megatron}
    for dtype_key in ("params_dtype", "pipeline_dtype"):
        if isinstance(kwargs[dtype_key], str):
            kwargs[dtype_key] = getattr(torch, kwargs[dtype_key])
    with quiet_megatron_deprecations():
        return TransformerConfig(**kwargs)


def _moe_config(arch: HFArchitecture) -> dict[str, Any]:
    """The `TransformerConfig` MoE fields that reproduce the HF router and experts (none if dense).

    Router, HF -> Megatron: softmax over all experts then top-k (Qwen3-MoE without
    norm_topk_prob) is ``moe_router_pre_softmax``; with norm_topk_prob the renormalised top-k
    weights equal a softmax over the k chosen logits, Megatron's default. Sigmoid scores choose by
    score + e_score_correction_bias (``moe_router_enable_expert_bias``) and are renormalised, then
    scaled by routed_scaling_factor (``moe_router_topk_scaling_factor``)."""
    if not arch.is_moe:
        return {}
    config: dict[str, Any] = {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_intermediate_size,
        "moe_router_topk": arch.moe_topk,
        "moe_layer_freq": [int(i in arch.moe_layers) for i in range(arch.num_layers)],
        "moe_router_score_function": arch.router_score,
        "moe_router_pre_softmax": arch.router_score == "softmax" and not arch.norm_topk_prob,
        "moe_router_enable_expert_bias": arch.expert_bias,
        "moe_shared_expert_intermediate_size": arch.shared_expert_intermediate_size or None,
        "moe_router_topk_scaling_factor": (
            arch.routed_scaling_factor if arch.routed_scaling_factor != 1.0 else None
        ),
        # Grouped GEMM needs the grouped_gemm/TransformerEngine kernels: one MLP per expert instead.
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "alltoall",
        # RL trains the policy the engine sampled from: no load-balancing loss and no drift of the
        # expert bias unless asked for (``megatron``: moe_aux_loss_coeff, moe_router_bias_update_rate).
        "moe_aux_loss_coeff": 0.0,
        "moe_router_bias_update_rate": 0.0,
    }
    if arch.router_groups > 1:
        config["moe_router_num_groups"] = arch.router_groups
        config["moe_router_group_topk"] = arch.router_group_topk
    return config


def layer_spec(arch: HFArchitecture, config=None):
    """Megatron's local layer spec with `PackedCausalAttention` as core attention; for an MoE model
    the decoder block spec of this pipeline stage (dense and MoE layers, `config.moe_layer_freq`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from palaestra.trainer.packed_attention import PackedCausalAttention

    if not arch.is_moe:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
        return spec
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    return block


def build_model(arch: HFArchitecture, config, ddp_options: dict[str, Any], adapt=None):
    """`GPTModel` for this pipeline stage, wrapped in Megatron's `DistributedDataParallel`.

    `adapt(gpt)` runs before the wrapping (LoRA adds its factors and freezes the rest there):
    DDP's gradient buffers, and so the optimizer, hold only what still requires a gradient."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if arch.vocab_size % tp:
        raise ValueError(f"vocab size {arch.vocab_size} is not divisible by tensor_model_parallel_size {tp}")
    with quiet_megatron_deprecations():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(arch, config),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,  # logprobs are computed vocab-parallel (losses.vocab_parallel_logprobs)
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            rotary_percent=arch.rotary_percent,
        )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if adapt is not None:
        adapt(model)
    ddp_config = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, **ddp_options})
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


@contextlib.contextmanager
def quiet_megatron_deprecations() -> Iterator[None]:
    """Hides megatron-core's notices about its own API churn (e.g. "tp_group is None, using default
    tp group", raised on every linear layer call); they are addressed to Megatron's developers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", message=r".*(full scope is deprecated|ffn_hidden_size)")
        yield


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` inside Megatron's DDP wrapper."""
    while hasattr(model, "module"):
        model = model.module
    return model
