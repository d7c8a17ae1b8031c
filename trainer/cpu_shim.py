"""Every CPU workaround the trainer needs for megatron-core 0.16.1, in one place.

megatron-core is written for GPUs. On a machine without CUDA a handful of its modules still ask
for the CUDA device, so the trainer's megatron-core path fails before the first forward pass. This
module lists each of those places, why it is there, and the smallest change that lets the same code
run on CPU. `install()` does nothing at all when CUDA is available: a GPU run is plain megatron-core.

Mechanism: instead of patching `torch` globally, each affected Megatron module gets its own
module-level name `torch` rebound to `_CpuTorch`, a thin proxy of the real `torch` that

* answers `torch.cuda.current_device()` with ``"cpu"`` (so ``device=torch.cuda.current_device()``
  allocates on CPU) and makes `torch.cuda.synchronize()` a no-op, and
* rewrites ``device="cuda"`` in the tensor factories (`tensor`, `zeros`, `ones`, `empty`, `full`)
  to ``"cpu"``.

Everything else is forwarded to the real `torch`, so any CUDA call not listed here still fails
loudly rather than silently doing something else. Nothing outside the listed modules is touched.

The places (megatron-core 0.16.1):

=========================================================  ==========================================
module                                                     why it asks for CUDA
=========================================================  ==========================================
models.common.embeddings.rotary_pos_embedding              `RotaryEmbedding.get_emb` moves `inv_freq`
                                                           to `torch.cuda.current_device()` on first
                                                           use (RoPE)
utils                                                      `GlobalMemoryBuffer.get_tensor` (the local
                                                           `DotProductAttention` score buffer)
                                                           allocates on the current CUDA device
tensor_parallel.layers, tensor_parallel.mappings           gather/scatter buffers for TP > 1
pipeline_parallel.schedules                                the token counter of every schedule is a
                                                           ``device="cuda"`` tensor
pipeline_parallel.p2p_communication                        receive buffers and the shapes exchanged
                                                           between stages are made on the current
                                                           CUDA device
distributed.param_and_grad_buffer                          DDP's contiguous grad buffers live on the
                                                           current CUDA device
optimizer.optimizer                                        `FP32Optimizer`'s loss scale and the
                                                           mixed-precision found-inf flags are
                                                           ``device="cuda"`` tensors
optimizer.clip_grads                                       grad-norm and count-zeros reductions use
                                                           ``device="cuda"`` tensors
transformer.moe.token_dispatcher                           the all-to-all dispatcher copies its split
                                                           sizes to the host on a side CUDA stream
                                                           (`torch.cuda.Stream`, `stream`,
                                                           `current_stream`, an event to wait on)
transformer.moe.router                                     the router moves its weight to the current
                                                           device on first use; its expert-bias and
                                                           token-count buffers are made there
transformer.moe.experts                                    the grouped experts' weights are made on
                                                           the current device
transformer.moe.moe_utils                                  the router-loss tracker (aux/z-loss per
                                                           layer) is a ``device="cuda"`` tensor
=========================================================  ==========================================

On CPU there is one stream: `torch.cuda.Stream()` and `current_stream()` are the same object,
whose `wait_stream` and recorded events do nothing (every op has finished when it returns), and
`torch.cuda.stream(s)` is an empty context.

Two that are not device strings:

* `optimizer.clip_grads.clip_grad_by_total_norm_fp32` asserts
  ``param.grad.type() == "torch.cuda.FloatTensor"`` before scaling the gradients. The name is
  rebound (in `clip_grads` and in `optimizer.optimizer`, which imported it) to
  `_clip_grad_by_total_norm_cpu`: the same coefficient, max_norm / (total_norm + 1e-6), applied
  with `torch._foreach_mul_` when it is below 1. The norm itself is still Megatron's
  `get_grad_norm_fp32` (with the device proxy above).

* The CUDA RNG tracker (`tensor_parallel.random`) reads and sets CUDA generator states when
  dropout layers fork it. `setup_rng()` installs Megatron's own inference tracker
  (`initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)`), whose `fork()` is a
  no-op: on CPU the only generator is torch's CPU generator, seeded by `torch.manual_seed`. The
  trainer runs with dropout 0, so no random numbers are drawn in a forward pass anyway.

Not shimmed, on purpose: Megatron's *distributed* optimizer (ZeRO-1, ``use_distributed_optimizer``)
classifies parameters by `param.type() == "torch.cuda.FloatTensor"` and raises `TypeError` for CPU
tensors; it also needs reduce-scatter, which gloo lacks. `check_supported()` refuses it on CPU
with that explanation; the plain Megatron optimizer with DDP all-reduce is used instead. Also
refused on CPU: bf16/fp16 (Megatron's mixed-precision optimizer), sequence parallelism and
``average_in_collective`` (gloo has no reduce-scatter and no AVG), and the overlapped grad-reduce /
param-gather (CUDA streams).

* `transformer.moe.moe_utils` defines `te_general_gemm` only when TransformerEngine imports, but
  the router's gating linear (`RouterGatingLinearFunction`) tests ``te_general_gemm is not None``
  unconditionally (a NameError without TE). The name is set to None, which selects its torch.mm
  path: the intended fallback. This one is a missing-TE bug, not a CUDA one, so it applies on GPU
  boxes without TE too.

* The all-to-all dispatcher's `maybe_move_tensor_to_cpu(t, as_numpy=True)` turns the split sizes
  into numpy arrays only when they are CUDA tensors; on CPU they stay tensors, which
  `all_to_all_single` does not take as split sizes. `token_dispatcher`'s name is rebound to
  `_to_host`, which converts a CPU tensor the way the CUDA path converts a CUDA one.

Also here, because every megatron import goes through it first: `import_megatron()`, which imports
megatron-core without its import-time notices (missing TransformerEngine/Apex, deprecations).
"""

from __future__ import annotations

import contextlib
import importlib
import types
import warnings
from typing import Any

import torch

__all__ = ["PATCHED_MODULES", "check_supported", "import_megatron", "install", "installed", "setup_rng"]

PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
)

_installed = False


def _cpu_device(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    return device


def _factory(fn):
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs CUDA
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped


class _CpuStream:
    """The one CPU "stream": every op is done when it returns, so there is nothing to wait for."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def record_event(self) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        return None


_STREAM = _CpuStream()


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as the patched modules see it: the current device is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def Stream(*_: Any, **__: Any) -> _CpuStream:  # noqa: N802 (torch's name)
        return _STREAM

    @staticmethod
    def current_stream(*_: Any) -> _CpuStream:
        return _STREAM

    @staticmethod
    def stream(_stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """`torch` as the patched modules see it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in ("tensor", "zeros", "ones", "empty", "full"):
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """Megatron's `clip_grad_by_total_norm_fp32` without its CUDA-type assertion (module docstring)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` for a CPU run (module docstring)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def import_megatron() -> None:
    """Imports the megatron-core modules the trainer uses, without their import-time notices.

    megatron-core warns at import that TransformerEngine/Apex are missing (it then uses its torch
    fallbacks, which is the intended setup on CPU) and emits deprecation notices about its own
    internals; neither is actionable for a user of the trainer.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning
        )
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        for name in (
            "megatron.core",
            "megatron.core.models.gpt",
            "megatron.core.models.gpt.gpt_layer_specs",
            "megatron.core.optimizer",
            "megatron.core.distributed",
            "megatron.core.pipeline_parallel",
        ):
            importlib.import_module(name)


def installed() -> bool:
    """Whether the shim is active in this process (never on a CUDA machine)."""
    return _installed


def install() -> bool:
    """Rebinds `torch` in `PATCHED_MODULES` to the CPU proxy; a no-op when CUDA is available.

    Idempotent. Returns True when the shim is (now) active.
    """
    global _installed
    import_megatron()
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):  # no TransformerEngine (module docstring)
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(
                f"cpu_shim: {name} no longer imports torch as `torch`; "
                "this shim was written for megatron-core 0.16.1 — review it for this version"
            )
        module.torch = proxy
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    importlib.import_module(
        "megatron.core.transformer.moe.token_dispatcher"
    ).maybe_move_tensor_to_cpu = _to_host
    _installed = True
    return True


def setup_rng(seed: int) -> None:
    """Seeds torch and sets up Megatron's RNG tracker (the CUDA one on GPU, a no-op one on CPU)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def check_supported(megatron_options: dict[str, Any]) -> None:
    """Raises a clear error for Megatron options that cannot run without CUDA."""
    if torch.cuda.is_available():
        return
    if megatron_options.get("use_distributed_optimizer"):
        raise ValueError(
            "use_distributed_optimizer needs CUDA with megatron-core 0.16.1: its DistributedOptimizer "
            "accepts only parameters whose type() is torch.cuda.*Tensor, and gloo has no "
            "reduce-scatter. On CPU leave it off (Megatron's optimizer with DDP all-reduce is used)."
        )
    for key in ("bf16", "fp16"):
        if megatron_options.get(key):
            raise ValueError(f"{key}=True needs CUDA (Megatron's mixed-precision optimizer); use fp32 on CPU")
    if megatron_options.get("sequence_parallel"):
        raise ValueError("sequence_parallel needs reduce-scatter, which the gloo backend lacks; off on CPU")
    for key in ("overlap_grad_reduce", "overlap_param_gather"):
        if megatron_options.get(key):
            raise ValueError(f"{key} overlaps communication on a CUDA stream; off on CPU")
    if megatron_options.get("average_in_collective"):
        raise ValueError("average_in_collective needs ReduceOp.AVG, which the gloo backend lacks; off on CPU")
