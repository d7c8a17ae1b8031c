"""`TrainerConfig`: every option of the trainer, typed, with what it means and its unit.

Megatron's own options pass through untouched under Megatron's names, in three dicts:
``megatron`` (`TransformerConfig` fields, parallel sizes included: ``tensor_model_parallel_size``,
``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``, ...),
``megatron_ddp`` (`DistributedDataParallelConfig`) and ``megatron_optimizer`` (`OptimizerConfig`:
``lr``, ``weight_decay``, ``adam_beta1``, ``clip_grad``, ...). The trainer re-declares none of them.
The trainer's own options are grouped in sections, one dataclass each: `kl` (`KlOptions`), `opd`
(`OpdOptions`), `tis` and `rs` (`TisOptions`, `RsOptions`: the train/rollout mismatch
corrections), `sync` (`SyncOptions`), `snapshot` (`SnapshotOptions`), `lora` (`LoraOptions`) and
`dynamic_sampling` (`DynamicSamplingOptions`: read by the orchestrator, which builds the batches).
The flat keys they replace (``sync_mode``, ``opd_kl_coef``, ...: `RENAMED`) are still read, from
YAML, overrides and saved configs, for one release, each with a one-line deprecation warning naming
the new key (palaestra/typed_config.py). `to_dict()` is what a checkpoint stores next to the weights.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from palaestra.trainer.estimators import ESTIMATORS, load_estimator
from palaestra.trainer.lora import LoraOptions
from palaestra.typed_config import move_renamed

if TYPE_CHECKING:
    from palaestra.trainer.opd_panel import TeacherPanel

__all__ = [
    "DynamicSamplingOptions",
    "KlOptions",
    "OpdOptions",
    "RsOptions",
    "SnapshotOptions",
    "SyncOptions",
    "TisOptions",
    "TrainerConfig",
]

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
class KlOptions:
    """The KL penalty towards the reference model."""

    coef: float = 0.0
    """β_kl of the KL to the reference model (the initial weights, held in the `ref` snapshot);
    0 = no KL and no reference copy."""

    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token with d = lp − ref: k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d."""

    mode: Literal["loss", "reward"] = "loss"
    """loss: + β_kl·kl_t in the loss (differentiable through lp); reward: Â_t −= β_kl·kl_t (detached)."""


@dataclass
class OpdOptions:
    """On-policy distillation: one teacher (teacher_mode) or a panel of them (teachers; docs/opd.md)."""

    kl_coef: float = 0.0
    """β of on-policy distillation: Â_t = A_t − β·(lp_t − teacher_t). 0 = no teacher is consulted."""

    teacher_mode: Literal["megatron", "sglang"] | None = None
    """Where teacher logprobs come from when kl_coef > 0 (samples that already carry
    `teacher_logprobs` are not rescored)."""

    teacher_model: str | None = None
    """megatron mode: the teacher's HF directory (`palaestra train` resolves a preset name to it);
    same architecture as the student."""

    teacher_urls: list[str] = field(default_factory=list)
    """sglang mode: teacher engine URLs (or one router URL)."""

    teacher_concurrency: int = 8
    """sglang mode: scoring requests in flight."""

    teachers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The teacher panel, name -> options (docs/opd.md): ``mode`` (megatron | sglang), ``model``
    (megatron: HF directory or preset), ``urls`` (sglang), ``opd_kl_coef`` (default: kl_coef),
    ``granularity`` (sampled | topk | full), ``topk`` (k, default 8), ``concurrency``, ``envs``
    (environments routed to it besides its namesake). Empty = the single teacher of teacher_mode."""

    teacher_routing: str = "env"
    """Which teacher scores a sample: env (the teacher named like Sample.env, then one listing the env
    in ``envs``, then ``default``) or ``package.module:function`` with the signature
    ``route(sample, teacher_names) -> name | {name: weight}``."""

    teacher_mixtures: dict[str, dict[str, float]] = field(default_factory=dict)
    """env -> {teacher: weight}: samples of that env are distilled towards the weighted mixture of
    those teachers' distributions (they must share a granularity)."""

    granularity: Literal["sampled", "topk", "full"] = "sampled"
    """Granularity of the single teacher of teacher_mode (a panel sets it per teacher). sampled: the
    reverse-KL estimate on the sampled token, in the advantage; topk: reverse KL over the student's
    top-k tokens, renormalised, as a loss term; full: exact reverse KL over the vocabulary (megatron)."""

    topk: int = 8
    """k of the single teacher's topk granularity."""

    full_chunk_rows: int = 256
    """Rows per chunk of the full-vocabulary KL: its extra memory is chunk_rows x vocabulary floats."""

    def __post_init__(self) -> None:
        if self.teachers and self.teacher_mode is not None:
            raise ValueError("set either teachers (a panel) or teacher_mode (one teacher), not both")
        if self.kl_coef and self.teacher_mode is None and not self.teachers:
            raise ValueError(
                "kl_coef > 0 needs teacher_mode ('megatron' or 'sglang') or teachers; "
                "or opd.kl_coef: 0 for no distillation"
            )
        if self.teachers:
            self.panel()  # validates every entry, the routing path and the mixtures
        if self.full_chunk_rows <= 0:
            raise ValueError(f"full_chunk_rows must be positive; got {self.full_chunk_rows}")
        if self.teacher_mode == "megatron" and not self.teacher_model:
            raise ValueError(
                "teacher_mode 'megatron' needs teacher_model (a HF directory); or teacher_mode: null "
                "for no teacher"
            )
        if self.teacher_mode == "sglang" and not self.teacher_urls:
            raise ValueError("teacher_mode 'sglang' needs teacher_urls; or teacher_mode: null for no teacher")

    @property
    def enabled(self) -> bool:
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
                    "granularity": self.granularity,
                    "topk": self.topk,
                    "concurrency": self.teacher_concurrency,
                }
            }
        if not teachers:
            return None
        return TeacherPanel.from_config(teachers, self.kl_coef, self.teacher_routing, self.teacher_mixtures)


@dataclass
class TisOptions:
    """Truncated importance sampling of the train/rollout mismatch."""

    enabled: bool = False
    """Multiply each token's policy loss by clip(exp(old − roll), clip_low, clip_high)."""

    clip_low: float = 0.0
    """Lower TIS bound."""

    clip_high: float = 2.0
    """Upper TIS bound."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low <= self.clip_high:
            raise ValueError(
                f"clip_low: need 0 <= clip_low <= clip_high; got {self.clip_low}, {self.clip_high}"
            )


@dataclass
class RsOptions:
    """Rejection sampling of the train/rollout mismatch."""

    mode: Literal["token", "sequence"] | None = None
    """Drop tokens (token) or whole sequences (sequence, geometric-mean ratio) whose exp(old − roll)
    leaves [low, high]. None = off."""

    low: float = 0.5
    """Lower RS bound (inclusive)."""

    high: float = 2.0
    """Upper RS bound (inclusive)."""

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"low: need 0 <= low <= high; got {self.low}, {self.high}")


@dataclass
class SyncOptions:
    """The weight sync to the engines after each step (trainer/weight_sync.py)."""

    mode: Literal["shm", "distributed", "ipc", "tensor", "disk"] = "shm"
    """shm = one safetensors file in /dev/shm, loaded with /update_weights_from_disk (engines on
    this host; the fast path); distributed = a broadcast group with every engine,
    /update_weights_from_distributed (engines on other GPUs or nodes); ipc =
    /update_weights_from_tensor with CUDA IPC handles (SGLang colocated on the trainer's GPUs);
    tensor = /update_weights_from_tensor with serialized bytes (slow); disk = safetensors under
    dir + /update_weights_from_disk (any engine that sees dir)."""

    bucket_mb: int = 512
    """Largest tensor bucket per /update_weights_from_tensor call, MiB."""

    retries: int = 3
    """Attempts per engine call before the sync fails (engines are then left paused)."""

    timeout_s: float = 300.0
    """HTTP timeout of one sync call, seconds."""

    dir: str | None = None
    """disk mode: directory the engines can read; each version goes to dir/v<version>.
    shm mode: where the shared file goes instead of /dev/shm (None = /dev/shm)."""

    group_address: str | None = None
    """distributed mode: the address engines use to reach trainer rank 0's rendezvous (the master of
    the weight-update group). None = 127.0.0.1 when every engine is on loopback, else this host's
    address on the route to the first engine."""

    group_port: int = 0
    """distributed mode: the rendezvous port on trainer rank 0's host (0 = a free one; fix it when a
    firewall needs a known port)."""

    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    """/pause_generation mode during a sync."""

    def __post_init__(self) -> None:
        if not 0 <= self.group_port < 65536:
            raise ValueError(f"group_port must be between 0 and 65535; got {self.group_port}")


@dataclass
class SnapshotOptions:
    """Where the weight snapshots (actor, ref, old_actor, teachers) live."""

    host_budget_gb: float | None = None
    """CPU memory for weight snapshots, GB; tags beyond it spill to spill_dir and are read back on
    demand. None = every snapshot stays in CPU memory. Must hold at least two copies of the weights."""

    spill_dir: str | None = None
    """Directory of spilled snapshots (safetensors); None = a temporary directory."""

    prefetch: bool = True
    """Bring the next teacher from disk into CPU memory in the background while the model computes."""

    def __post_init__(self) -> None:
        if self.host_budget_gb is not None and self.host_budget_gb <= 0:
            raise ValueError(f"host_budget_gb must be positive or null; got {self.host_budget_gb}")


@dataclass
class DynamicSamplingOptions:
    """Dynamic sampling (DAPO's): groups whose rewards are all equal carry no reward signal, so they
    are dropped before training and the step's batch is refilled with new groups (docs/training.md,
    "Groups"). A run whose rewards do not reach the advantage (advantage_estimator none or sft: pure
    on-policy distillation trains on a flat group too) keeps every group."""

    enabled: bool = False
    """Drop zero-reward-variance groups and refill the batch. sync: generate more groups before the
    step; async: keep taking (and admitting) groups until the step has env.tasks_per_step informative
    ones. Not in one_step_off mode (its batches are sampled by exactly the previous weights)."""

    max_rounds: int = 4
    """Generation rounds per step at most, the first included (async: max_rounds x tasks_per_step
    groups looked at); then the step trains on the informative groups it has (none: no update)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_rounds <= 1000:
            raise ValueError(f"max_rounds must be between 1 and 1000; got {self.max_rounds}")


SECTIONS: dict[str, type] = {
    "kl": KlOptions,
    "opd": OpdOptions,
    "tis": TisOptions,
    "rs": RsOptions,
    "sync": SyncOptions,
    "snapshot": SnapshotOptions,
    "lora": LoraOptions,
    "dynamic_sampling": DynamicSamplingOptions,
}
"""TrainerConfig's sections: field name -> its dataclass."""

RENAMED: dict[str, str] = {
    "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator",
    "kl_mode": "kl.mode",
    "opd_kl_coef": "opd.kl_coef",
    "teacher_mode": "opd.teacher_mode",
    "teacher_model": "opd.teacher_model",
    "teacher_urls": "opd.teacher_urls",
    "teacher_concurrency": "opd.teacher_concurrency",
    "teacher_routing": "opd.teacher_routing",
    "teacher_mixtures": "opd.teacher_mixtures",
    "teachers": "opd.teachers",
    "opd_granularity": "opd.granularity",
    "opd_topk": "opd.topk",
    "opd_full_chunk_rows": "opd.full_chunk_rows",
    "use_tis": "tis.enabled",
    "tis_clip_low": "tis.clip_low",
    "tis_clip_high": "tis.clip_high",
    "rs_mode": "rs.mode",
    "rs_low": "rs.low",
    "rs_high": "rs.high",
    "sync_mode": "sync.mode",
    "sync_bucket_mb": "sync.bucket_mb",
    "sync_retries": "sync.retries",
    "sync_timeout_s": "sync.timeout_s",
    "sync_dir": "sync.dir",
    "sync_group_address": "sync.group_address",
    "sync_group_port": "sync.group_port",
    "sync_pause_mode": "sync.pause_mode",
    "snapshot_host_budget_gb": "snapshot.host_budget_gb",
    "snapshot_spill_dir": "snapshot.spill_dir",
    "snapshot_prefetch": "snapshot.prefetch",
}
"""The flat keys of earlier releases -> their key in a section (read with a deprecation warning)."""


@dataclass
class TrainerConfig:
    RENAMED = RENAMED  # read by palaestra.typed_config (a class attribute, not an option)

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
    supervised fine-tuning on the given responses. none: 0 (rewards ignored): with opd.kl_coef > 0,
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

    kl: KlOptions = field(default_factory=KlOptions)
    """The KL penalty towards the reference model (coef, estimator, mode)."""

    opd: OpdOptions = field(default_factory=OpdOptions)
    """On-policy distillation: β, the teacher or the teacher panel, and its granularity."""

    tis: TisOptions = field(default_factory=TisOptions)
    """Truncated importance sampling of the train/rollout mismatch (off by default)."""

    rs: RsOptions = field(default_factory=RsOptions)
    """Rejection sampling of the train/rollout mismatch (off by default)."""

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

    sync: SyncOptions = field(default_factory=SyncOptions)
    """The weight sync to the engines: transport (mode), buckets, retries, timeouts, pause mode."""

    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)
    """Weight snapshots in CPU memory, and the disk they spill to beyond a budget."""

    lora: LoraOptions = field(default_factory=LoraOptions)
    """LoRA adapters instead of full fine-tuning (trainer/lora.py; docs/trainer.md, "LoRA"):
    ``rank`` > 0 turns them on. The base stays frozen and is the reference policy (no ``ref``
    copy), the optimizer holds the adapters only, and the weight sync sends only them (SGLang's
    /load_lora_adapter; sync.mode shm or disk)."""

    dynamic_sampling: DynamicSamplingOptions = field(default_factory=DynamicSamplingOptions)
    """Drop groups whose rewards are all equal and refill the step's batch (enabled, max_rounds)."""

    def __post_init__(self) -> None:
        for name, section in SECTIONS.items():  # from_dict / a checkpoint's saved config
            if isinstance(getattr(self, name), dict):
                setattr(self, name, section(**getattr(self, name)))
        if self.routing_replay is False:  # YAML 1.1 reads a bare `off` as false
            self.routing_replay = "off"
        if self.routing_replay not in ("off", "r2", "r3"):
            raise ValueError(f"routing_replay must be off, r2 or r3; got {self.routing_replay!r}")
        self.megatron_optimizer = {**DEFAULT_OPTIMIZER, **self.megatron_optimizer}
        if self.lora.enabled and self.sync.mode not in ("shm", "disk"):
            raise ValueError(
                f"lora: adapters reach the engines as PEFT directories (/load_lora_adapter), so "
                f"sync.mode must be shm (engines on this host) or disk (sync.dir every engine reads); "
                f"got {self.sync.mode!r}"
            )
        if self.advantage_estimator not in ESTIMATORS:  # a table name needs no import
            load_estimator(self.advantage_estimator)  # an import path is imported now; errors say why
        if not self.advantage_eps > 0:  # grpo divides a zero-variance group's 0 by std + eps
            raise ValueError(f"advantage_eps must be positive (e.g. 1e-6); got {self.advantage_eps}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be at least 1; got {self.dp_size}")
        if self.max_tokens_per_microbatch <= 0:
            raise ValueError("max_tokens_per_microbatch must be positive")

    @property
    def rewards_train(self) -> bool:
        """Whether rewards reach the advantage: every estimator but ``sft`` and ``none`` (an OPD-only
        run: its teacher's signal needs no reward variance, so a flat group still trains)."""
        return self.advantage_estimator not in ("sft", "none")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        """From `to_dict()`'s form (a checkpoint's saved config); an earlier release's flat keys are
        moved to their sections with a deprecation warning."""
        data = copy.deepcopy(data)
        problems = move_renamed(cls, data, "trainer")
        if problems:
            raise ValueError("; ".join(problems))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown trainer options: {unknown}")
        return cls(**data)
