"""The trainer: `Sample`s in, better weights out, pushed to the inference engines.

    trainer = Trainer(TrainerConfig(...), model_dir, engine_urls=["http://127.0.0.1:30001"])
    metrics = trainer.step(samples)     # one optimizer step, then weight sync
    metrics = trainer.step(samples, sync=False); ...; trainer.sync_weights()   # the sync apart
    trainer.save("ckpt/step-10"); trainer.load("ckpt/step-10"); trainer.export_hf("hf-out")
    trainer.export_adapter("adapter-out")   # with trainer.lora: the PEFT adapter

`Trainer.step` is the algorithm; everything it calls lives in a module of its own:

    schedule     pack samples into micro-batches, spread them over DP ranks   (packing.py)
    teacher      route samples to the teacher panel, score them per teacher   (opd_step.py, opd_panel.py)
    ref / old    logprobs of the reference and the pre-update policy           (snapshots.py;
                 `old` from the update's own forward when nothing needs it first)
    advantages   estimator per sample (a name or an import path), per-token terms (estimators.py,
                 OPD, KL-reward, RS, TIS                           advantages.py, objective.py)
    train        PPO-clip loss with TIS/RS/KL, one optimizer step    (objective.py, losses.py)
    sync         new weights to every engine as weight_version                 (weight_sync.py)

With ``lora.rank`` > 0 the same recipe trains LoRA adapters (lora.py): the base is frozen, `ref`
is the base itself (the adapters switched off, no snapshot), `old_actor` the previous step's
adapters, teachers run with the adapters off, and the sync sends the adapters only.

Simplifications, on purpose: one optimizer step per call (no PPO epochs or mini-batches — call
`step` again for more); constant learning rate (`megatron_optimizer["lr"]`). Tensor and data
parallelism work (Megatron's own options), expert parallelism for mixture-of-experts models
(moe.py), and pipeline parallelism (untied embeddings on CPU); context parallelism is refused with
the reason. With several processes every rank calls `step`; rank 0's samples are used.

The trainer owns the weight version: `step` adds one per optimizer step, and the engines get
exactly that number with the weights; whoever drives it reads `weight_version`, never counts.
`model_dir` (and a megatron-mode `opd.teacher_model`) are HF directories: resolving a preset name to
its directory is the caller's job (in a `palaestra train` run, the trainer's Ray actor does it).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from palaestra.sample import Sample
from palaestra.trainer import advantages as adv
from palaestra.trainer import cpu_shim, losses, moe, objective, opd_kl
from palaestra.trainer.config import TrainerConfig
from palaestra.trainer.convert import (
    HFArchitecture,
    ep_globalize,
    ep_localize,
    hf_to_megatron,
    megatron_to_hf,
    pp_globalize,
    pp_stage,
    tp_shard,
    tp_unshard,
)
from palaestra.trainer.estimators import AdvantageContext, estimate, load_estimator
from palaestra.trainer.lora import Adapters, check_rank, inject, is_adapter_param
from palaestra.trainer.megatron_model import (
    build_model,
    init_parallel,
    quiet_megatron_deprecations,
    transformer_config,
    unwrap,
)
from palaestra.trainer.opd_step import Distiller
from palaestra.trainer.packing import MicroBatch, build_micro_batch, dummy_micro_batch, schedule
from palaestra.trainer.snapshots import SnapshotStore
from palaestra.trainer.weight_sync import WeightSync

__all__ = ["Trainer", "format_metrics"]

# megatron-core 0.16.1 gathers expert-parallel tokens with all_gather_into_tensor, which torch 2.13
# deprecates at every call: a line per rank per step in a run's log that no user can act on
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
)

_UNSUPPORTED_PARALLEL = {
    "context_parallel_size": "context parallelism needs TransformerEngine attention; the local spec has none",
}


def _model_directory(path: str | Path | None, field: str) -> Path:
    """`path` as a directory with an HF `config.json`, or a ValueError naming `field`."""
    if path is None or not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{field} must be an HF model directory (with config.json); got {path!r}. The trainer "
            "takes directories: resolve a preset name to its directory first"
        )
    return Path(path)


def _check_pipeline(arch: HFArchitecture, config: TrainerConfig) -> None:
    """What pipeline parallelism does not cover yet, refused with the reason."""
    if arch.tie_word_embeddings and not torch.cuda.is_available():
        raise ValueError(
            "pipeline_model_parallel_size > 1 with tied embeddings needs CUDA: megatron-core's "
            "LanguageModule.setup_embeddings_and_output_layer moves the shared weight with .cuda()"
        )
    if config.lora.enabled:
        raise ValueError(
            "pipeline_model_parallel_size > 1 with trainer.lora is not supported (adapters gather over TP only)"
        )
    recompute = [k for k in ("recompute_granularity", "moe_layer_recompute") if config.megatron.get(k)]
    if config.routing_replay != "off" and recompute:
        raise ValueError(
            f"routing_replay with pipeline_model_parallel_size > 1 and trainer.megatron.{recompute[0]} is not "
            "supported: 1F1B runs other micro-batches' forwards before a recompute reads the replayed routing"
        )


def format_metrics(metrics: dict[str, float]) -> str:
    """One console line: the keys that matter most first."""
    keys = ["train/step", "train/loss", "train/nll", "train/pg_loss", "train/kl", "train/entropy", "train/clipfrac",
            "train/grad_norm", "opd/reverse_kl", "mismatch/logprob_abs_diff", "perf/tokens_per_s"]  # fmt: skip
    return " ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in keys if k in metrics)


class Trainer:
    def __init__(self, config: TrainerConfig, model_dir: str | Path, engine_urls: Sequence[str] = ()):
        """`model_dir`: the student's HF directory (a preset's name must be resolved by the caller)."""
        cpu_shim.import_megatron()
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        self.config = config
        self.model_dir = _model_directory(model_dir, "model_dir")
        self.estimator = load_estimator(config.advantage_estimator)
        panel = config.opd.panel() if config.opd.enabled else None
        for name, spec in (panel.specs if panel is not None else {}).items():  # fail before building
            if spec.mode == "megatron":
                _model_directory(
                    spec.model,
                    "opd.teacher_model" if not config.opd.teachers else f"opd.teachers.{name}.model",
                )
        self.arch = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
        cpu_shim.check_supported({**config.megatron_ddp, **config.megatron_optimizer, **config.megatron})
        moe.check_layout(self.arch, config.megatron)
        if int(config.megatron.get("pipeline_model_parallel_size") or 1) > 1:
            _check_pipeline(self.arch, config)
        if config.routing_replay != "off" and not self.arch.is_moe:
            raise ValueError(
                f"routing_replay: {config.routing_replay} replays mixture-of-experts routing; "
                f"{self.arch.architecture} is a dense model (set routing_replay: off)"
            )
        for key, why in _UNSUPPORTED_PARALLEL.items():
            if int(config.megatron.get(key) or 1) != 1:
                raise ValueError(f"{key} > 1 is not supported by this trainer: {why}")
        init_parallel(config.megatron, config.dist_init_method)
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size()
        if dp != config.dp_size:
            raise ValueError(
                f"dp_size is {config.dp_size}, but {dist.get_world_size()} ranks with tensor_model_parallel_size "
                f"{parallel_state.get_tensor_model_parallel_world_size()} make {dp} data-parallel replicas"
            )
        cpu_shim.setup_rng(config.seed)
        replay = config.routing_replay != "off"
        self.transformer_config = transformer_config(
            self.arch, {**config.megatron, "moe_enable_routing_replay": True} if replay else config.megatron
        )
        self.lora: Adapters | None = None  # LoRA adapters (lora.py); None: full fine-tuning
        if config.lora.enabled:
            check_rank(config.lora, self.arch)  # before building anything
        self.model = build_model(
            self.arch,
            self.transformer_config,
            config.megatron_ddp,
            self._inject if config.lora.enabled else None,
        )
        self.gpt = unwrap(self.model)
        self.replay = self._routing_replay() if replay else None  # routing_replay r2 / r3
        self.load_hf_weights(self.model_dir)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**config.megatron_optimizer), [self.model])
        self._wire_megatron_schedule()

        budget = config.snapshot.host_budget_gb
        self.snapshots = SnapshotStore(
            self.gpt,
            live_tag="actor",
            host_budget_bytes=None if budget is None else int(budget * 1e9),
            spill_dir=config.snapshot.spill_dir,
            prefetch=config.snapshot.prefetch,
            # with LoRA the base only (the adapters are swapped apart); a teacher's own expert bias
            # (GLM/DeepSeek routers) switches with its weights, or it would route by the student's
            params=[*self.base_parameters(), *self.routing_buffers()],
        )
        if config.kl.coef > 0 and self.lora is None:  # with LoRA the reference is the frozen base
            self.snapshots.save("ref")
        if config.keep_old_actor:
            self._save_old_actor()
        self.base_checksum = self._base_checksum() if self.lora is not None else None
        self.distiller = Distiller(self, panel) if panel is not None else None
        self.sync = (
            WeightSync(
                engine_urls,
                mode=config.sync.mode,
                bucket_mb=config.sync.bucket_mb,
                retries=config.sync.retries,
                timeout_s=config.sync.timeout_s,
                disk_dir=config.sync.dir,
                pause_mode=config.sync.pause_mode,
                group_address=config.sync.group_address,
                group_port=config.sync.group_port,
            )
            if engine_urls
            else None
        )
        self.step_count = 0
        self.weight_version = 0
        if self.lora is not None and self.sync is not None and dist.get_rank() == 0:
            # An engine that cannot take the adapter fails now, with the flag to add. The engines
            # serve the adapter from the first `sync_weights()` on (`palaestra train` calls it
            # before the first request; until then B = 0 would give the base model anyway).
            self.sync.check_lora(self.config.lora.rank, list(self.lora.targets))

    # ==========================================================================================
    # The algorithm
    # ==========================================================================================
    def step(self, samples: Sequence[Sample], *, sync: bool = True) -> dict[str, float]:
        """One RL/OPD step over `samples`: returns namespaced metrics (train/, opd/, mismatch/, perf/).

        With `sync` (and engines to sync to) the new weights go to every engine before it returns;
        `sync=False` leaves that to a later `sync_weights()` (a driver that must drain generation
        or pause a gateway first)."""
        started = time.perf_counter()
        samples = self._broadcast(list(samples))
        samples, replay_metrics = self._keep_replayable(samples)
        mbs, plan_metrics = self._schedule(samples)
        if self.config.routing_replay == "r3":  # the rollout engine's routing, replayed (moe.py)
            for mb in mbs:
                if not mb.dummy:
                    mb.routing = moe.rollout_routing(samples, mb.sample_indices, self.arch)
        routes = self.distiller.route(samples) if self.distiller is not None else []
        ref = ["ref"] if self.config.kl.coef > 0 else []
        old_policy = "old_actor" if self.config.keep_old_actor else "actor"
        k = self.distiller.topk_needed(routes) if self.distiller is not None else 0
        # Without a reason to run it apart, the old-policy pass is the update's own forward (the
        # same weights and micro-batches give the same numbers; see `separate_old_pass`)
        fused = self.separate_old_pass(k) is None
        teachers = self.distiller.snapshot_order(routes) if self.distiller is not None else []
        old_tags = [] if fused else [old_policy]
        plan = [t for t in [*old_tags, *teachers, *ref, "actor"] if t in self.snapshots]  # LoRA: no ref/old
        self.snapshots.plan(plan)  # eviction and prefetch order
        t_old = time.perf_counter()
        topk_ids: dict[int, torch.Tensor] = {}
        if not fused:
            with self._routing("record" if self.config.routing_replay == "r2" else "replay"):
                old, topk_ids = self._student_pass(mbs, old_policy, k)
            self._store(mbs, "old_logprobs", old)
        t_teacher = time.perf_counter()
        opd_metrics = (
            self.distiller.score(samples, mbs, routes, topk_ids) if self.distiller is not None else {}
        )
        t_score = time.perf_counter()
        if self.config.kl.coef > 0:
            self._store(mbs, "ref_logprobs", self.logprobs(mbs, tag="ref"))
        # fused: each micro-batch's per-token inputs once the update's forward has its old logprobs
        # (`inputs`, built only then); apart: here, from the old pass's
        per_sample, signal_metrics = self._advantages(samples, [] if fused else mbs)
        inputs = partial(objective.token_inputs, per_sample=per_sample, c=self.config) if fused else None
        if self.config.keep_old_actor:
            self._save_old_actor()  # the next step's "old" = these pre-update weights
        t_update = time.perf_counter()
        # The next step will most likely switch in the same order: saying so now lets the store
        # prefetch its first teacher from disk while this step trains.
        self.snapshots.plan(plan)
        with self._routing("replay"):
            metrics = self._train(mbs, inputs)
        metrics.update(replay_metrics)
        metrics.update(signal_metrics)
        metrics.update(opd_metrics)
        metrics.update(self.snapshots.stats())
        if self.distiller is not None:
            metrics.update(self.distiller.route_metrics(mbs))
        metrics["perf/teacher_s"] = t_score - t_teacher  # teacher scoring (OPD)
        metrics["perf/score_s"] = (t_teacher - t_old) + (t_update - t_score)  # old/ref passes, advantages
        metrics["perf/update_s"] = time.perf_counter() - t_update  # forward+backward+optimizer
        metrics["perf/old_pass_fused"] = float(fused)  # 1: the old logprobs came from the update's forward
        self.step_count += 1
        self.weight_version += 1
        metrics.update(plan_metrics)
        metrics["train/step"] = float(self.step_count)
        metrics["train/weight_version"] = float(self.weight_version)
        metrics["train/reward_mean"] = sum(s.reward for s in samples) / max(1, len(samples))
        if sync and self.sync is not None:
            metrics.update(self.sync_weights())
        elapsed = time.perf_counter() - started
        metrics["perf/step_s"] = elapsed
        metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / elapsed
        return metrics

    # ==========================================================================================
    # Mechanics
    # ==========================================================================================
    def _broadcast(self, samples: list[Sample]) -> list[Sample]:
        if dist.get_world_size() == 1:
            return samples
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _schedule(self, samples: list[Sample]) -> tuple[list[MicroBatch], dict[str, float]]:
        """This DP rank's micro-batches (`packing.schedule`, order `dp_balance`) and schedule metrics."""
        from megatron.core import parallel_state

        if not samples:
            raise ValueError("step() needs at least one sample")
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        lengths = [len(s.tokens) for s in samples]
        plan = schedule(
            lengths, self.config.max_tokens_per_microbatch, dp_size, self.arch, self.config.dp_balance
        )
        mbs = [build_micro_batch(samples, plan.bins[b]) for b in plan.per_rank[dp_rank]]
        if not mbs:  # fewer micro-batches than DP ranks: run one that trains nothing
            mbs = [dummy_micro_batch()]
        loads = plan.rank_flops()
        return mbs, {
            "perf/microbatches": float(len(plan.bins)),
            "perf/pack_fill_ratio": plan.fill_ratio(self.config.max_tokens_per_microbatch),
            "perf/dp_load_max_over_mean": max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0,
        }

    def _keep_replayable(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """With routing_replay r3, the samples whose `routed_experts` fit the model; every other one
        is dropped with its reason (a warning), never trained on with routing of its own."""
        if self.config.routing_replay != "r3":
            return samples, {}
        kept, reasons = [], []
        for s in samples:
            problem = moe.routing_problem(s, self.arch)
            if problem is None:
                kept.append(s)
            else:
                reasons.append(f"sample {s.sample_id}: {problem}")
        if not kept:
            raise ValueError(
                "routing_replay r3: no sample has a usable routed_experts: " + "; ".join(reasons[:5])
            )
        if reasons:
            warnings.warn(
                f"routing_replay r3 dropped {len(reasons)} sample(s): " + "; ".join(reasons[:5]), stacklevel=3
            )
        return kept, {"train/routing_replay_dropped": float(len(reasons))}

    def _routing_replay(self) -> moe.RoutingReplay:
        """This model's routers under replay: under pipeline parallelism, this stage's MoE layers."""
        _, _, stages, first = self._pp()
        layers = range(first, first + self.arch.num_layers // stages)
        own = [j for j, layer in enumerate(self.arch.moe_layers) if layer in layers]
        return moe.RoutingReplay(self.gpt, own, len(self.arch.moe_layers))

    @contextlib.contextmanager
    def _routing(self, mode: str):
        """The policy passes within record (r2's old pass) or replay (the rest) MoE routing; a no-op
        with routing_replay off."""
        if self.replay is None:
            yield
            return
        with self.replay.active(mode):
            yield

    @staticmethod
    def _store(mbs: list[MicroBatch], name: str, values: list[torch.Tensor]) -> None:
        for mb, v in zip(mbs, values, strict=True):
            setattr(mb, name, v)
            mb.check()

    def _student_pass(
        self, mbs: list[MicroBatch], tag: str, k: int
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Logprobs of the sampled tokens with weights `tag` and, if k > 0, each sample's top-k ids
        per response row (what topk teachers score) — one forward pass for both."""
        group = self.tp()[0]

        def rows_fn(mb: MicroBatch, rows: torch.Tensor) -> dict[str, torch.Tensor]:
            lp = losses.vocab_parallel_logprobs(rows, mb.targets.to(rows.device), self.config.temperature)
            out = {"logprobs": lp.detach().float().cpu()}
            if k > 0:
                out["topk"] = opd_kl.select_topk(rows, k, group).cpu()
            return out

        outs = self.forward_rows(mbs, tag, rows_fn)
        ids: dict[int, torch.Tensor] = {}
        if k > 0:
            for mb, o in zip(mbs, outs, strict=True):
                ids.update(zip(mb.sample_indices, mb.per_sample(o["topk"]), strict=True))
        return [o["logprobs"] for o in outs], ids

    def teacher_logprobs(self, samples: list[Sample]) -> list[list[float]] | None:
        """Per sample, its teacher's (or mixture's) logprob of each response token, for the
        trajectory viewer; None without teachers. Also records `Sample.teacher`."""
        if self.distiller is None:
            return None
        # rank 0 has the samples; the others score them too, since a forward pass under expert,
        # tensor or pipeline parallelism is a collective (rank 0 alone waited forever under EP = 2)
        samples = self._broadcast(samples)
        return self.distiller.viewer_logprobs(samples) if samples else None

    def _advantages(
        self, samples: list[Sample], mbs: Sequence[MicroBatch]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The estimator's advantage per sample (`advantage_estimator`: a name in the table of
        estimators.py or a user's import path), [N], and the group metrics; then the per-token
        inputs of `mbs`, which have their old logprobs (`objective.token_inputs`: OPD and
        KL-reward terms, RS masks, TIS weights)."""
        ctx = AdvantageContext.of(samples, self.config.advantage_eps)
        per_sample = estimate(self.estimator, ctx, self.config.advantage_estimator)
        for mb in mbs:
            objective.token_inputs(mb, per_sample, self.config)
        flat, groups = adv.zero_variance_groups(ctx.rewards, ctx.group_ids, ctx.session_ids)
        return per_sample, {"train/groups": float(groups), "train/zero_variance_groups": float(flat)}

    def separate_old_pass(self, k: int = 0) -> str | None:
        """Why this step's old logprobs need a forward pass of their own before the update (`k`:
        the top-k ids a `topk` teacher scores), or None: the update's forward gives them.

        One optimizer step per `step` means the update's forward runs the weights the old pass
        would (the live actor) over the same micro-batches, and no per-token input of the loss
        (advantage, TIS, RS, KL-reward and sampled-OPD terms) looks beyond its own micro-batch; so
        each micro-batch's old logprobs can be that forward's own, detached, before its loss. The
        pass stays apart where something else than the loss needs it first, or where a forward
        in training mode differs from one in eval mode."""
        c, tc = self.config, self.transformer_config
        if c.keep_old_actor:
            return "keep_old_actor: the old policy is the previous step's weights"
        if c.routing_replay == "r2":
            return "routing_replay r2: the old pass records the routing the update replays"
        if k > 0:
            return "a topk teacher scores the student's top-k ids before the update"
        if tc.hidden_dropout or tc.attention_dropout:
            return "dropout: a forward in training mode is not the old policy's"
        if tc.moe_input_jitter_eps is not None:
            return "moe_input_jitter_eps: every MoE forward draws its own noise"
        if tc.moe_router_load_balancing_type == "sinkhorn":
            return "sinkhorn routing chooses other experts in training mode"
        return None

    def _inject(self, gpt: torch.nn.Module) -> None:
        """LoRA factors into the fresh model, everything else frozen (before DDP wraps it)."""
        self.lora = inject(gpt, self.arch, self.config.lora, self.config.seed)

    # -- forward passes through Megatron's schedule --------------------------------------------
    def _wire_megatron_schedule(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        cfg = self.transformer_config
        cfg.no_sync_func = self.model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = self.optimizer.scale_loss

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def _forward_step(self, loss_fn, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        dev = self._device()
        if self.replay is not None:
            self.replay.before_forward(mb)
        logits = model(
            mb.tokens.to(dev)[None],
            mb.position_ids.to(dev)[None],
            None,
            packed_seq_params=mb.packed_seq_params(dev),
        )
        if self.replay is not None:
            self.replay.after_forward(mb)
        return logits, partial(loss_fn, mb)

    def _run(self, mbs: list[MicroBatch], loss_fn, forward_only: bool) -> list[Any]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with quiet_megatron_deprecations():
            out = get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn),
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=len(mbs),
                seq_length=max(mb.num_tokens for mb in mbs),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # only the last stage computed the outputs; every stage stores them in its micro-batches
            box = [out]
            dist.broadcast_object_list(
                box,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            out = box[0]
        return out

    def _rows(self, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        return logits[0, mb.label_positions.to(logits.device)]

    def logprobs(
        self, mbs: list[MicroBatch], tag: str = "actor", temperature: float | None = None
    ) -> list[torch.Tensor]:
        """Per micro-batch, log_softmax(logits / T)[token] of every response row, with weights `tag`."""
        t = self.config.temperature if temperature is None else temperature
        return [o["logprobs"] for o in self.forward_rows(mbs, tag, partial(self._logprob_rows, t))]

    def _logprob_rows(
        self, temperature: float, mb: MicroBatch, rows: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        lp = losses.vocab_parallel_logprobs(rows, mb.targets.to(rows.device), temperature)
        return {"logprobs": lp.detach().float().cpu()}

    def forward_rows(
        self,
        mbs: list[MicroBatch],
        tag: str,
        fn: Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]],
    ) -> list[dict[str, torch.Tensor]]:
        """Forward-only passes with weights `tag`: per micro-batch, `fn(mb, logits of its response
        rows [R, V/tp])`. The live weights are `tag` during the passes and the actor afterwards."""

        def loss(mb: MicroBatch, logits: torch.Tensor):
            out = fn(mb, self._rows(mb, logits))
            return logits.new_zeros(()), torch.zeros((), dtype=torch.int), out

        with self._policy(tag):
            self.model.eval()
            with torch.no_grad():
                return self._run(mbs, loss, forward_only=True)

    @contextlib.contextmanager
    def _policy(self, tag: str):
        """The live model computes as `tag` for the duration: that snapshot switched in; with LoRA
        the base with the adapters off for `ref` (no snapshot) and for teachers (full models of
        their own), the previous step's adapters for `old_actor`."""
        lora = self.lora
        if lora is None or tag not in ("actor", "ref", "old_actor"):
            self.snapshots.switch(tag)
        try:
            if lora is None or tag == "actor":
                yield
            elif tag == "old_actor":
                with lora.old():
                    yield
            else:
                with lora.disabled():
                    yield
        finally:
            self.snapshots.switch("actor")

    def _save_old_actor(self) -> None:
        if self.lora is not None:
            self.lora.save_old()
        else:
            self.snapshots.save("old_actor")

    def _policy_loss(self, inputs: Callable[[MicroBatch], None] | None, mb: MicroBatch, logits: torch.Tensor):
        num, den, sums = objective.microbatch_loss(mb, self._rows(mb, logits), self.config, inputs)
        return num, torch.tensor(den, dtype=torch.int, device=logits.device), {"sums": sums}

    def _train(
        self, mbs: list[MicroBatch], inputs: Callable[[MicroBatch], None] | None = None
    ) -> dict[str, float]:
        """One forward/backward over `mbs` and one optimizer step. `inputs`: the old pass is fused,
        so each micro-batch's old logprobs and per-token inputs (`inputs(mb)`) are filled from its
        own forward, before its loss."""
        from megatron.core import parallel_state

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with moe.RouterStats(self.gpt) as routers:
            out = self._run(mbs, partial(self._policy_loss, inputs), forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if self.lora is None:  # with LoRA the base (all the store holds) did not change
            self.snapshots.mark_live_changed()
        sums = torch.stack([o["sums"] for o in out]).sum(0)
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        metrics = objective.step_metrics(sums, self.config)
        metrics["train/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["train/update_successful"] = float(bool(ok))
        metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update(routers.metrics(parallel_state.get_data_parallel_group()))
        return metrics

    # ==========================================================================================
    # Weights in and out
    # ==========================================================================================
    def tp(self) -> tuple[Any, int, int]:
        """(tensor-parallel group, this rank in it, its size)."""
        return self._tp()

    def _tp(self) -> tuple[Any, int, int]:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        return group, dist.get_rank(group), dist.get_world_size(group)

    def gather_tp(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-model tensors from this rank's TP shards (a collective over the TP group)."""
        group, _, size = self._tp()
        if size == 1:
            return local
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for r in range(size):
                shards[r][name] = parts[r]
        return tp_unshard(shards)

    def _ep(self) -> tuple[Any, int, int]:
        """(expert-parallel group, this rank in it, its size)."""
        from megatron.core import parallel_state

        size = parallel_state.get_expert_model_parallel_world_size()
        if size == 1:
            return None, 0, 1
        return (
            parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_model_parallel_rank(),
            size,
        )

    def gather_ep(self, full_tp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every expert of the model from each EP rank's own (a collective over the EP group)."""
        group, _, size = self._ep()
        if size == 1:
            return full_tp
        parts: list[Any] = [None] * size
        mine = {k: v.cpu() for k, v in full_tp.items() if ".local_experts." in k}
        dist.all_gather_object(parts, mine, group=group)
        rest = {k: v for k, v in full_tp.items() if ".local_experts." not in k}
        return {**rest, **ep_globalize(parts)}

    def _pp(self) -> tuple[Any, int, int, int]:
        """(pipeline group, this stage, the number of stages, this stage's first layer)."""
        from megatron.core import parallel_state

        size = parallel_state.get_pipeline_model_parallel_world_size()
        if size == 1:
            return None, 0, 1, 0
        rank = parallel_state.get_pipeline_model_parallel_rank()
        return (
            parallel_state.get_pipeline_model_parallel_group(),
            rank,
            size,
            rank * self.arch.num_layers // size,
        )

    def gather_model(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-model tensors from this rank's own (collectives over TP, EP, then PP)."""
        full = self.gather_ep(self.gather_tp(local))
        group, _, size, first = self._pp()
        if size == 1:
            return full
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in pp_globalize(full, first).items()}, group=group)
        return {k: v for part in parts for k, v in part.items()}

    def _stage(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's experts (EP) and this stage's layers (PP) of whole-model tensors."""
        _, ep_rank, ep_size = self._ep()
        full = ep_localize(full, ep_rank, ep_size, self.arch.num_experts)
        _, stage, stages, first = self._pp()
        if stages == 1:
            return full
        return pp_stage(full, first, self.arch.num_layers // stages, stage == 0, stage == stages - 1)

    def shard_model(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of whole-model tensors: its experts (EP), its layers (PP), its TP shard."""
        return self.shard_tp(self._stage(full))

    def shard_tp(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's TP shard of whole-model tensors."""
        _, rank, size = self._tp()
        return tp_shard(full, rank, size)

    def base_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's own weights by Megatron name: every parameter but the LoRA adapters."""
        return [(n, p) for n, p in self.gpt.named_parameters() if not is_adapter_param(n)]

    def routing_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors of the model that are not parameters but part of its weights: the MoE routers'
        expert bias (GLM/DeepSeek's e_score_correction_bias; fixed while training, see
        megatron_model._moe_config)."""
        return [(n, b) for n, b in self.gpt.named_buffers() if n.endswith("router.expert_bias")]

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """The live weights of the whole model by Megatron name (gathered over TP: a collective);
        with LoRA the base weights, without the adapters (`adapter_state`)."""
        local = {name: p.detach() for name, p in [*self.base_parameters(), *self.routing_buffers()]}
        return self.gather_model(local)

    def hf_state(self, merged: bool = False) -> dict[str, torch.Tensor]:
        """The live weights by HF name, on CPU (a collective over TP). With LoRA: the base
        weights, or with `merged` the base with every adapter folded in (W + (α/r)·B·A)."""
        hf = {k: v.cpu() for k, v in megatron_to_hf(self.megatron_state(), self.arch).items()}
        if merged and self.lora is not None:
            from palaestra.trainer.export import merge_into

            hf = merge_into(hf, self.adapter_state(), self.lora.scale)
        return hf

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA factors of the whole model by PEFT name, on CPU (a collective over TP)."""
        assert self.lora is not None, "adapter_state() needs trainer.lora"
        return {k: v.cpu() for k, v in self.lora.gather(self.lora.local_state(), self.tp()[0]).items()}

    def _base_checksum(self) -> str:
        """`weights_format.base_checksum` of the base weights (what an adapter of this trainer needs)."""
        from palaestra.weights_format import base_checksum

        return base_checksum(self.hf_state().items())

    @torch.no_grad()
    def load_megatron_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies whole-model Megatron tensors into the live model (this rank takes its TP shard)."""
        params = dict([*self.base_parameters(), *self.routing_buffers()])
        tensors = self._stage(tensors)  # this rank's experts and layers
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        if missing or extra:
            raise KeyError(f"Megatron weights: missing {missing[:5]}, unexpected {extra[:5]}")
        local = self.shard_tp(tensors)
        for name, p in params.items():
            if tuple(local[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint {tuple(local[name].shape)}, model {tuple(p.shape)}")
            p.copy_(local[name])

    def load_hf_weights(self, model_dir: str | Path) -> None:
        """Reads HF safetensors from `model_dir` into the live model (converted to Megatron names)."""
        from palaestra.weights_format import read_safetensors

        self.load_megatron_state(hf_to_megatron(dict(read_safetensors(model_dir)), self.arch))
        if hasattr(self, "snapshots"):
            self.snapshots.mark_live_changed()
        if getattr(self, "base_checksum", None) is not None:  # LoRA: adapters now belong to this base
            self.base_checksum = self._base_checksum()

    def sync_weights(self) -> dict[str, float]:
        """Pushes the live weights to every engine as `weight_version` (global rank 0 sends)."""
        if self.sync is None:
            return {}
        if self.snapshots.live != "actor":
            raise RuntimeError(f"the live weights are {self.snapshots.live!r}, not the actor")
        error, report = None, None
        adapter = self.adapter_state() if self.lora is not None else None  # a collective over TP
        named = list(self.hf_state().items()) if self.lora is None else []
        if dist.get_rank() == 0:
            try:
                if self.lora is not None:
                    config = self.lora.peft_config(str(self.model_dir))
                    report = self.sync.push_adapter(
                        self.config.lora.name, config, adapter, self.weight_version, self.base_checksum
                    )
                else:
                    report = self.sync.push(named, self.weight_version)
            except Exception as exc:  # every rank must learn about it, or the others hang
                error = exc
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        if box[0] is not None:
            raise RuntimeError(f"weight sync failed on rank 0: {box[0]}")
        if report is None:
            return {}
        return {
            "perf/sync_s": report.seconds,
            "perf/sync_bytes": float(report.bytes),  # with LoRA the adapter's alone
            "perf/sync_gb_per_s": report.bytes / max(report.seconds, 1e-9) / 1e9,
            "perf/sync_buckets": float(report.buckets),
            "perf/sync_pause_s": report.pause_seconds,  # the engines generated nothing meanwhile
            **{f"perf/sync_phase_{name}_s": seconds for name, seconds in report.phases.items()},
        }

    def save(self, path: str | Path) -> None:
        """Checkpoint: model, optimizer, RNG, step, weight version, config (checkpoint.py)."""
        from palaestra.trainer import checkpoint

        checkpoint.save(self, Path(path))

    def load(self, path: str | Path) -> None:
        """Resumes from a checkpoint written by `save`."""
        from palaestra.trainer import checkpoint

        checkpoint.load(self, Path(path))

    def export_hf(self, path: str | Path) -> Path:
        """HF directory (safetensors with HF names + config + tokenizer) that engines load; with
        LoRA the adapters merged into the base."""
        from palaestra.trainer import checkpoint

        return checkpoint.export_hf(self, Path(path))

    def export_adapter(self, path: str | Path) -> Path:
        """The LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors)
        that `peft` and SGLang load (a collective over TP; rank 0 writes)."""
        from palaestra.trainer import export

        return export.export_adapter(self, Path(path))
