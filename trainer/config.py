"""`TrainerConfig`: every option of the trainer, typed, with what it means and its unit.

Megatron's own options pass through untouched under Megatron's names, in three dicts:
``megatron`` (`TransformerConfig` fields, parallel sizes included: ``tensor_model_parallel_size``,
``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``, ...),
``megatron_ddp`` (`DistributedDataParallelConfig`) and ``megatron_optimizer`` (`OptimizerConfig`:
``lr``, ``weight_decay``, ``adam_beta1``, ``clip_grad``, ...). The trainer re-declares none of them.
`to_dict()` is what a checkpoint stores next to the weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from palaestra.trainer.estimators import ESTIMATORS, load_estimator
from palaestra.trainer.lora import LoraOptions

if TYPE_CHECKING:
    from palaestra.trainer.opd_panel import TeacherPanel

__all__ = ["TrainerConfig"]

DEFAULT_OPTIMIZER: dict[str, Any] = {
    "optimizer": "adam",
    "lr": 1e-6,
    "min_lr": 0.0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.98,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
}


@dataclass
class TrainerConfig:
    seed: int = 1234
    """Seed of torch's generators (and Megatron's RNG tracker on GPU)."""

    dist_init_method: str | None = None
    """torch.distributed rendezvous for multi-process runs (RANK/WORLD_SIZE set): None = env://
    (MASTER_ADDR/MASTER_PORT), or e.g. file:///shared/rdzv. A single process needs none."""

    dp_size: int = 1
    """Data-parallel replicas. `palaestra train` starts dp_size × tensor_model_parallel_size trainer
    ranks (Ray actors, placed by `run.placement` / `run.resources`), each DP replica training on
    its share of the batch (`dp_balance`) with gradients all-reduced by Megatron's DDP (gloo on
    CPU, NCCL on GPU). A trainer started another way (torchrun: WORLD_SIZE) checks that its world
    size gives this many replicas."""

    megatron: dict[str, Any] = field(default_factory=dict)
    """`TransformerConfig` fields applied over what the HF config implies (parallel sizes too).
    Architecture fields (layers, heads, sizes, norm, GLU, biases) may not contradict the HF config."""

    megatron_ddp: dict[str, Any] = field(default_factory=dict)
    """`DistributedDataParallelConfig` fields (``grad_reduce_in_fp32`` defaults to True)."""

    megatron_optimizer: dict[str, Any] = field(default_factory=dict)
    """`OptimizerConfig` fields, merged over `DEFAULT_OPTIMIZER` (Adam, lr 1e-6, clip_grad 1.0)."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts. Trainer logprobs are log_softmax(logits / T), the
    engine's convention for sampled tokens; 0 (greedy) means 1."""

    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed micro-batch (tokens of whole samples; a longer sample runs alone)."""

    dp_balance: Literal["pack_first", "distribute_first"] = "distribute_first"
    """How samples reach DP ranks. distribute_first: Karmarkar-Karp over samples by estimated FLOPs,
    then pack per rank (max/mean rank load 1.000 on a long-tailed batch over 8 ranks). pack_first:
    pack micro-batches, then give them to ranks by Karmarkar-Karp (1.058 on the same batch; see
    bench/trainer.py)."""

    advantage_estimator: str = "grpo"
    """How rewards become one advantage per sample: a name from the table (trainer/estimators.py)
    or ``package.module:function``, your own ``estimator(ctx: AdvantageContext) -> Tensor[N]``
    (docs/trainer.md). grpo: (r − mean_g)/(std_g + eps); dr_grpo: r − mean_g;
    reinforce_pp_baseline: r − mean_g, whitened over the batch's loss tokens. Groups by
    `Sample.group_id`, sessions counted once. sft: 1 for every sample (rewards ignored), i.e.
    supervised fine-tuning on the given responses. none: 0 (rewards ignored): with opd_kl_coef > 0,
    pure on-policy distillation."""

    advantage_eps: float = 1e-6
    """eps in the std divisions of grpo and reinforce_pp_baseline."""

    eps_clip: float = 0.2
    """PPO clip: the ratio is clipped to [1 − eps_clip, 1 + eps_clip_high]."""

    eps_clip_high: float | None = None
    """Upper clip (clip-higher, DAPO); None = eps_clip."""

    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages: loss ≤ −A·c. None = off."""

    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """token_mean: mean over every loss token of the global batch; seq_mean: mean over sequences
    of each sequence's token mean."""

    kl_coef: float = 0.0
    """β_kl of the KL to the reference model (the initial weights, held in the `ref` snapshot);
    0 = no KL and no reference copy."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token with d = lp − ref: k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d."""

    kl_mode: Literal["loss", "reward"] = "loss"
    """loss: + β_kl·kl_t in the loss (differentiable through lp); reward: Â_t −= β_kl·kl_t (detached)."""

    opd_kl_coef: float = 0.0
    """β of on-policy distillation: Â_t = A_t − β·(lp_t − teacher_t). 0 = no teacher is consulted."""

    teacher_mode: Literal["megatron", "sglang"] | None = None
    """Where teacher logprobs come from when opd_kl_coef > 0 (samples that already carry
    `teacher_logprobs` are not rescored)."""

    teacher_model: str | None = None
    """megatron mode: the teacher's HF directory (`palaestra train` resolves a preset name to it);
    same architecture as the student."""

    teacher_urls: list[str] = field(default_factory=list)
    """sglang mode: teacher engine URLs (or one router URL)."""

    teacher_concurrency: int = 8
    """sglang mode: scoring requests in flight."""

    use_tis: bool = False
    """Truncated importance sampling: multiply each token's policy loss by
    clip(exp(old − roll), tis_clip_low, tis_clip_high)."""

    tis_clip_low: float = 0.0
    """Lower TIS bound."""

    tis_clip_high: float = 2.0
    """Upper TIS bound."""

    rs_mode: Literal["token", "sequence"] | None = None
    """Rejection sampling of train/rollout mismatch: drop tokens (token) or whole sequences
    (sequence, geometric-mean ratio) whose exp(old − roll) leaves [rs_low, rs_high]. None = off."""

    rs_low: float = 0.5
    """Lower RS bound (inclusive)."""

    rs_high: float = 2.0
    """Upper RS bound (inclusive)."""

    keep_old_actor: bool = False
    """Compute the PPO 'old' logprobs with the previous step's weights (kept in the `old_actor`
    snapshot) — for one-step-off-policy rollouts. False: the weights before this step's update.
    `palaestra train` sets it from run.mode (true exactly for one_step_off) unless given."""

    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Mixture-of-experts routing in the policy's training passes (trainer/moe.py): off = the
    router chooses anew in every pass; r2 = the update replays the experts the old-policy pass
    chose; r3 = the old-policy pass and the update replay the rollout engine's choice
    (`Sample.routed_experts`; a sample without a matching one is dropped, with the reason).
    r2/r3 need an MoE model."""

    sync_mode: Literal["shm", "distributed", "ipc", "tensor", "disk"] = "shm"
    """Weight sync (trainer/weight_sync.py): shm = one safetensors file in /dev/shm, loaded with
    /update_weights_from_disk (engines on this host; the fast path); distributed = a broadcast group
    with every engine, /update_weights_from_distributed (engines on other GPUs or nodes); ipc =
    /update_weights_from_tensor with CUDA IPC handles (SGLang colocated on the trainer's GPUs);
    tensor = /update_weights_from_tensor with serialized bytes (slow); disk = safetensors under
    sync_dir + /update_weights_from_disk (any engine that sees sync_dir)."""

    sync_bucket_mb: int = 512
    """Largest tensor bucket per /update_weights_from_tensor call, MiB."""

    sync_retries: int = 3
    """Attempts per engine call before the sync fails (engines are then left paused)."""

    sync_timeout_s: float = 300.0
    """HTTP timeout of one sync call, seconds."""

    sync_dir: str | None = None
    """disk mode: directory the engines can read; each version goes to sync_dir/v<version>.
    shm mode: where the shared file goes instead of /dev/shm (None = /dev/shm)."""

    sync_group_address: str | None = None
    """distributed mode: the address engines use to reach trainer rank 0's rendezvous (the master of
    the weight-update group). None = 127.0.0.1 when every engine is on loopback, else this host's
    address on the route to the first engine."""

    sync_group_port: int = 0
    """distributed mode: the rendezvous port on trainer rank 0's host (0 = a free one; fix it when a
    firewall needs a known port)."""

    sync_pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    """/pause_generation mode during a sync."""

    teachers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The teacher panel, name -> options (docs/opd.md): ``mode`` (megatron | sglang), ``model``
    (megatron: HF directory or preset), ``urls`` (sglang), ``opd_kl_coef`` (default: opd_kl_coef),
    ``granularity`` (sampled | topk | full), ``topk`` (k, default 8), ``concurrency``, ``envs``
    (environments routed to it besides its namesake). Empty = the single teacher of teacher_mode."""

    teacher_routing: str = "env"
    """Which teacher scores a sample: env (the teacher named like Sample.env, then one listing the env
    in ``envs``, then ``default``) or ``package.module:function`` with the signature
    ``route(sample, teacher_names) -> name | {name: weight}``."""

    teacher_mixtures: dict[str, dict[str, float]] = field(default_factory=dict)
    """env -> {teacher: weight}: samples of that env are distilled towards the weighted mixture of
    those teachers' distributions (they must share a granularity)."""

    opd_granularity: Literal["sampled", "topk", "full"] = "sampled"
    """Granularity of the single teacher of teacher_mode (a panel sets it per teacher). sampled: the
    reverse-KL estimate on the sampled token, in the advantage; topk: reverse KL over the student's
    top-k tokens, renormalised, as a loss term; full: exact reverse KL over the vocabulary (megatron)."""

    opd_topk: int = 8
    """k of the single teacher's topk granularity."""

    opd_full_chunk_rows: int = 256
    """Rows per chunk of the full-vocabulary KL: its extra memory is chunk_rows x vocabulary floats."""

    snapshot_host_budget_gb: float | None = None
    """CPU memory for weight snapshots (actor, ref, old_actor, teachers), GB; tags beyond it spill to
    snapshot_spill_dir and are read back on demand. None = every snapshot stays in CPU memory.
    Must hold at least two copies of the weights."""

    snapshot_spill_dir: str | None = None
    """Directory of spilled snapshots (safetensors); None = a temporary directory."""

    snapshot_prefetch: bool = True
    """Bring the next teacher from disk into CPU memory in the background while the model computes."""

    lora: LoraOptions = field(default_factory=LoraOptions)
    """LoRA adapters instead of full fine-tuning (trainer/lora.py; docs/trainer.md, "LoRA"):
    ``rank`` > 0 turns them on. The base stays frozen and is the reference policy (no ``ref``
    copy), the optimizer holds the adapters only, and the weight sync sends only them (SGLang's
    /load_lora_adapter; sync_mode shm or disk)."""

    def __post_init__(self) -> None:
        if self.routing_replay not in ("off", "r2", "r3"):
            raise ValueError(f"routing_replay must be off, r2 or r3; got {self.routing_replay!r}")
        if isinstance(self.lora, dict):  # from_dict / a checkpoint's saved config
            self.lora = LoraOptions(**self.lora)
        self.megatron_optimizer = {**DEFAULT_OPTIMIZER, **self.megatron_optimizer}
        if self.lora.enabled and self.sync_mode not in ("shm", "disk"):
            raise ValueError(
                f"lora: adapters reach the engines as PEFT directories (/load_lora_adapter), so "
                f"sync_mode must be shm (engines on this host) or disk (sync_dir every engine reads); "
                f"got {self.sync_mode!r}"
            )
        if self.advantage_estimator not in ESTIMATORS:  # a table name needs no import
            load_estimator(self.advantage_estimator)  # an import path is imported now; errors say why
        if self.teachers and self.teacher_mode is not None:
            raise ValueError("set either teachers (a panel) or teacher_mode (one teacher), not both")
        if self.opd_kl_coef and self.teacher_mode is None and not self.teachers:
            raise ValueError(
                "opd_kl_coef > 0 needs teacher_mode ('megatron' or 'sglang') or teachers; "
                "or opd_kl_coef: 0 for no distillation"
            )
        if self.teachers:
            self.panel()  # validates every entry, the routing path and the mixtures
        if not self.advantage_eps > 0:  # grpo divides a zero-variance group's 0 by std + eps
            raise ValueError(f"advantage_eps must be positive (e.g. 1e-6); got {self.advantage_eps}")
        if self.opd_full_chunk_rows <= 0:
            raise ValueError(f"opd_full_chunk_rows must be positive; got {self.opd_full_chunk_rows}")
        if self.snapshot_host_budget_gb is not None and self.snapshot_host_budget_gb <= 0:
            raise ValueError(
                f"snapshot_host_budget_gb must be positive or null; got {self.snapshot_host_budget_gb}"
            )
        if self.teacher_mode == "megatron" and not self.teacher_model:
            raise ValueError(
                "teacher_mode 'megatron' needs teacher_model (a HF directory); or teacher_mode: null "
                "for no teacher"
            )
        if self.teacher_mode == "sglang" and not self.teacher_urls:
            raise ValueError("teacher_mode 'sglang' needs teacher_urls; or teacher_mode: null for no teacher")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be at least 1; got {self.dp_size}")
        if not 0 <= self.sync_group_port < 65536:
            raise ValueError(f"sync_group_port must be between 0 and 65535; got {self.sync_group_port}")
        if self.max_tokens_per_microbatch <= 0:
            raise ValueError("max_tokens_per_microbatch must be positive")
        if not 0 <= self.tis_clip_low <= self.tis_clip_high:
            raise ValueError("need 0 <= tis_clip_low <= tis_clip_high")
        if not 0 <= self.rs_low <= self.rs_high:
            raise ValueError("need 0 <= rs_low <= rs_high")

    @property
    def opd_enabled(self) -> bool:
        """True when some teacher has β > 0 (OPD scoring runs)."""
        panel = self.panel()
        return panel is not None and any(t.opd_kl_coef > 0 for t in panel.specs.values())

    def panel(self) -> TeacherPanel | None:
        """The teacher panel: `teachers`, or the one teacher of teacher_mode named "teacher"; None without."""
        from palaestra.trainer.opd_panel import TeacherPanel

        teachers = self.teachers
        if not teachers and self.teacher_mode is not None:
            teachers = {
                "teacher": {
                    "mode": self.teacher_mode,
                    "model": self.teacher_model,
                    "urls": list(self.teacher_urls),
                    "granularity": self.opd_granularity,
                    "topk": self.opd_topk,
                    "concurrency": self.teacher_concurrency,
                }
            }
        if not teachers:
            return None
        return TeacherPanel.from_config(
            teachers, self.opd_kl_coef, self.teacher_routing, self.teacher_mixtures
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown trainer options: {unknown}")
        return cls(**data)
