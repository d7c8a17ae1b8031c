"""`palaestra train CONFIG.yaml [section.field=value ...]`: one RL/OPD run, end to end, on Ray.

    palaestra train configs/demo.yaml
    palaestra train configs/demo.yaml run.mode=async run.max_staleness=2 run.steps=50
    palaestra train configs/demo.yaml run.resume=true          # from the latest checkpoint

The loop, per step (`run.mode` decides what overlaps):

    batch   = the step's groups of samples, read from the gateway's /samples cursor
              sync:          generate step k, then train on it
              one_step_off:  generate step k+1 while training on step k (samples 1 version old)
              async:         generate continuously; samples older than run.max_staleness
                             versions are dropped or masked (counted)
    metrics = trainer.train(batch)              one optimizer step (Megatron)
    sync    = the new weights to every engine   (async: the gateway is paused around it, so
                                                 sessions in flight keep their tokens and go on
                                                 with the new version)
    log, checkpoint every run.checkpoint_every steps

Before the first and after the last step the student is evaluated greedily on `env.eval_tasks`
held-out tasks; the run ends with `reward_curve.png`, `viewer.html` and one summary line in the
output directory. Simplifications, on purpose: one trainer process group (data parallelism over
Ray actors is not wired); in sync and one-step-off modes a step whose groups are all filtered
makes no update (async mode fills its batch instead); an engine that dies stops the run with its
log tail (it is not replaced).

Ray places and supervises the boxes (`palaestra.orchestration`, `palaestra.actors`); what each mode
overlaps is `palaestra.modes`; metrics go through `palaestra.logging_utils`. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import secrets
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from palaestra.config import ConfigError, RunConfig, config_help, config_to_dict, load_config, save_config
from palaestra.logging_utils import console_line, make_tracker
from palaestra.modes import SOURCES
from palaestra.orchestration import (
    Batch,
    Cluster,
    RunFailed,
    SampleFeed,
    Waiter,
    init_ray,
    logical_cpus_needed,
)

__all__ = ["RunResult", "StepRecord", "register", "train"]

log = logging.getLogger("palaestra.train")

# Held-out tasks come from this seed of `env.tasks(seed)` — the same set for every run, whatever
# its training seed (a finite task list that ignores the seed is not held out: see docs/training.md).
EVAL_SEED = 1_000_003


# ----------------------------------------------------------------------------------------------
# What a run remembers (checkpointed) and what it returns
# ----------------------------------------------------------------------------------------------
@dataclass
class RunState:
    step: int = 0  # steps done
    weight_version: int = 0
    cursor: int = 0  # the gateway spool position read so far
    watermark: int = 0  # every task index below it was consumed (trained or dropped)
    consumed_above: list[int] = field(default_factory=list)  # consumed indices >= watermark (async)
    rows: list[dict[str, float]] = field(default_factory=list)  # per-step metrics (the reward curve)
    counts: dict[str, int] = field(default_factory=dict)  # run totals: drops, statuses, ...

    def consume(self, indices: list[int]) -> None:
        done = set(self.consumed_above) | set(indices)
        while self.watermark in done:
            done.discard(self.watermark)
            self.watermark += 1
        self.consumed_above = sorted(i for i in done if i > self.watermark)


@dataclass
class StepRecord:
    """What one step trained (the tests check the staleness bound and the data order with it)."""

    step: int
    trainer_version: int  # before the update
    task_indices: list[int]
    task_ids: list[str]
    sample_ids: list[str]
    lags: list[float]  # per trained sample, weight versions behind the trainer
    versions: list[list[str]]  # per trained sample, the weight versions that sampled its tokens
    masked: int  # samples trained with loss_mask zeroed (stale_policy mask)


@dataclass
class RunResult:
    output_dir: Path
    start_step: int
    start_weight_version: int
    start_cursor: int
    state: RunState
    engine_versions_start: list[str]
    engine_versions_end: list[str]
    trained: list[StepRecord]
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    startup_s: dict[str, float]
    summary: str
    reward_curve: Path | None = None
    viewer: Path | None = None
    teacher_accuracy: float | None = None  # env.eval_teacher: the teacher on the same tasks


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def train(cfg: RunConfig, *, on_step=None) -> RunResult:
    """Runs `cfg` to the end; raises RunFailed (with the failing box and its log) if it cannot.

    `on_step(step, cluster)`, if given, is called after every step (tests use it to inject faults).
    """
    out = cfg.output_dir
    state, ckpt = _prepare(cfg, out)
    _build_presets(cfg)
    t0 = time.perf_counter()
    started_ray = init_ray(cfg.run.host, logical_cpus_needed(cfg))
    ray_s = time.perf_counter() - t0
    run_id = secrets.token_hex(4)  # tells this launch's samples from a crashed one's in the spool
    cluster = Cluster(cfg)
    tracker = make_tracker(
        cfg.logging, out, run_name=cfg.run.name, config=config_to_dict(cfg), fresh=ckpt is None
    )
    try:
        cluster.start(
            weight_version=state.weight_version,
            run_id=run_id,
            spool_dir=str(out / "spool"),
            log_dir=str(out / "logs"),
        )
        cluster.startup_s["ray"] = ray_s
        log.info(
            "up: Ray %.1f s, engines %.1f s, router+gateway %.1f s, environment+trainer %.1f s; "
            "engines %s, router %s, gateway %s",
            ray_s,
            cluster.startup_s["engines"],
            cluster.startup_s["servers"] - cluster.startup_s["engines"],
            cluster.startup_s["all"] - cluster.startup_s["servers"],
            ", ".join(b.url for b in cluster.engines),
            cluster.router.url,
            cluster.gateway.url,
        )
        if ckpt is not None:  # the checkpoint's weights, optimizer, RNG; then onto the engines
            limit = cfg.run.step_timeout_s
            loaded = _ray_get(
                cluster.trainer_call("load", str(ckpt / "trainer")), "loading the checkpoint", limit
            )[0]
            if loaded["weight_version"] != state.weight_version:
                raise RunFailed(
                    f"{ckpt}: the trainer checkpoint is at weight version {loaded['weight_version']}, "
                    f"the run state at {state.weight_version}"
                )
            _ray_get(cluster.trainer_call("sync_weights"), "syncing the checkpoint's weights", limit)
        result = _Loop(cfg, cluster, state, tracker, run_id, resumed=ckpt is not None, on_step=on_step).run()
        return result
    finally:
        tracker.close()
        cluster.stop()
        if started_ray:
            import ray

            ray.shutdown()


def _ray_get(refs: list, phase: str, timeout_s: float) -> list:
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RunFailed(f"{phase} took longer than run.step_timeout_s={timeout_s:g} s") from None
    except ray.exceptions.RayError as exc:
        raise RunFailed(f"{phase} failed: {exc}") from None


def _prepare(cfg: RunConfig, out: Path) -> tuple[RunState, Path | None]:
    """The run's directory and its starting state: fresh, or the latest checkpoint's."""
    temperature = cfg.env.args.get("temperature", cfg.trainer.temperature)
    if temperature != cfg.trainer.temperature:
        raise RunFailed(
            f"env.args.temperature={temperature} but trainer.temperature={cfg.trainer.temperature}: the "
            "trainer's logprobs are only right at the sampling temperature; set trainer.temperature "
            "alone (the run passes it to the environment)"
        )
    latest = out / "checkpoints" / "latest"
    if latest.is_file() and not cfg.run.resume:
        raise RunFailed(
            f"{out} holds checkpoints of an earlier run: set run.resume=true to continue it, or "
            "choose another run.name / run.output_dir"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if not (cfg.run.resume and latest.is_file()):
        if cfg.run.resume:
            log.warning("run.resume: no checkpoint in %s; starting at step 0", out / "checkpoints")
        return RunState(), None
    ckpt = out / "checkpoints" / latest.read_text().strip()
    data = json.loads((ckpt / "state.json").read_text())
    state = RunState(**data)
    log.info("resuming from %s: step %d, weight version %d", ckpt, state.step, state.weight_version)
    return state, ckpt


class _Loop:
    def __init__(
        self, cfg, cluster: Cluster, state: RunState, tracker, run_id: str, *, resumed: bool, on_step
    ):
        self.cfg, self.cluster, self.state, self.tracker = cfg, cluster, state, tracker
        self.resumed, self.on_step = resumed, on_step
        self.out = cfg.output_dir
        self.feed = SampleFeed(cluster.gateway.url, cluster.api_key, run_id, cursor=state.cursor)
        self.waiter = Waiter(cluster, cfg.run.step_timeout_s)
        self.source = SOURCES[cfg.run.mode](cfg, cluster, self.feed, self.waiter, state)
        self.trained: list[StepRecord] = []
        self.last_samples: list = []
        self.counts: Counter[str] = Counter(state.counts)

    def run(self) -> RunResult:
        cfg, state = self.cfg, self.state
        start = {"step": state.step, "version": state.weight_version, "cursor": state.cursor}
        versions_start = self.cluster.engine_versions()
        _warn_off_policy(cfg)
        eval_before = None
        if cfg.env.eval_tasks and not self.resumed:
            eval_before = self.evaluate("before")
            state.rows.append({"train/step": 0.0, "eval/accuracy": eval_before["accuracy"]})
        bar = _progress(cfg.run.steps, state.step)
        if state.step < cfg.run.steps:
            self.source.begin(state.step)
        try:
            for step in range(state.step, cfg.run.steps):
                metrics = self.step(step)
                done = step + 1
                if cfg.env.eval_every and done % cfg.env.eval_every == 0 and done < cfg.run.steps:
                    metrics["eval/accuracy"] = self.evaluate(f"step{done}")["accuracy"]
                state.step, state.rows = done, [*state.rows, metrics]
                self.tracker.log(metrics, done)
                if done % cfg.logging.console_every == 0 or done == cfg.run.steps:
                    _print(console_line(done, cfg.run.steps, metrics), bar)
                if bar is not None:
                    reward = metrics.get("rollout/reward_mean", math.nan)
                    bar.set_postfix(reward=f"{reward:.3f}", refresh=False)
                    bar.update(1)
                every = cfg.run.checkpoint_every
                if (every and done % every == 0) or done == cfg.run.steps:
                    self.checkpoint()
                if self.on_step is not None:
                    self.on_step(step, self.cluster)
        finally:
            if bar is not None:
                bar.close()
            self.source.end()
            self.feed.close()
        eval_after = None
        if cfg.env.eval_tasks:
            eval_after = self.evaluate("after")
            self.tracker.log({"eval/accuracy": eval_after["accuracy"]}, state.step)
            if state.rows and state.step > 0:
                state.rows[-1]["eval/accuracy"] = eval_after["accuracy"]
        result = RunResult(
            output_dir=self.out,
            start_step=start["step"],
            start_weight_version=start["version"],
            start_cursor=start["cursor"],
            state=state,
            engine_versions_start=versions_start,
            engine_versions_end=self.cluster.engine_versions(),
            trained=self.trained,
            eval_before=eval_before,
            eval_after=eval_after,
            startup_s=dict(self.cluster.startup_s),
            summary="",
        )
        if eval_after is not None and cfg.env.eval_teacher and cfg.model.teacher:
            result.teacher_accuracy = self.evaluate_teacher()
        self.report(result)
        return result

    # -- one step ------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.waiter.start_step(step)
        gateway_s0 = self.cluster.gateway_overhead_s()
        version = self.state.weight_version
        batch = self.source.batch(step, version)
        t_batch = time.perf_counter()
        record = StepRecord(
            step=step,
            trainer_version=version,
            task_indices=[g.task_index for g in batch.groups],
            task_ids=[g.task_id for g in batch.groups],
            sample_ids=[s.sample_id for s in batch.samples],
            lags=batch.lags,
            versions=[sorted({v for v in s.weight_versions if v}) for s in batch.samples],
            masked=batch.counts["stale_masked"],
        )
        metrics = self.rollout_metrics(batch)
        if batch.samples:
            train = self.waiter.get(
                self.cluster.trainer_call("train", [], rank0_args=(batch.samples,)), "training"
            )[0]
            t_train = time.perf_counter()
            drain_s = self.source.before_sync(step)
            t_sync = time.perf_counter()
            sync = self.waiter.get(self.cluster.trainer_call("sync_weights"), "weight sync")[0]
            self.source.after_sync(step)
            self.state.weight_version += 1
            metrics.update(train)
            metrics.update(sync)
            metrics["perf/train_s"] = t_train - t_batch
            metrics["perf/drain_s"] = drain_s
            metrics["perf/sync_s"] = time.perf_counter() - t_sync
            self.trained.append(record)
            self.last_samples = batch.samples
        else:  # every group filtered: no update, the step still counts
            log.warning("step %d: no sample left to train after filtering (%s)", step + 1, dict(batch.counts))
            metrics.update({"perf/train_s": 0.0, "perf/drain_s": 0.0, "perf/sync_s": 0.0})
            self.source.after_sync(step)
        self.state.consume([g.task_index for g in batch.considered])
        self.state.cursor = self.feed.cursor
        wall = time.perf_counter() - t0
        metrics["train/step"] = float(step + 1)
        metrics["train/weight_version"] = float(self.state.weight_version)
        metrics["perf/step_wall_s"] = wall
        metrics["perf/wait_s"] = t_batch - t0
        metrics["perf/trainer_idle_s"] = max(0.0, wall - metrics["perf/train_s"] - metrics["perf/sync_s"])
        metrics["perf/gateway_s"] = self.cluster.gateway_overhead_s() - gateway_s0
        metrics["perf/samples_per_s"] = len(batch.samples) / wall
        return metrics

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        rewards = [r for g in batch.groups for r in g.rewards]
        statuses: Counter[str] = Counter()
        for g in batch.considered:
            statuses.update(g.statuses)
        self.counts.update(batch.counts)
        self.counts.update({f"sessions_{k}": v for k, v in statuses.items()})
        self.counts.update({f"feed_{k}": v for k, v in self.feed.counts.items()})
        self.feed.counts.clear()
        self.state.counts = dict(self.counts)
        samples = batch.samples
        m: dict[str, float] = {
            "rollout/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rollout/samples": float(len(samples)),
            "rollout/groups": float(len(batch.groups)),
            "rollout/sampled_tokens": float(sum(s.num_sampled for s in samples)),
            "rollout/response_len_mean": statistics.fmean(s.response_len for s in samples)
            if samples
            else 0.0,
            "rollout/staleness_mean": statistics.fmean(batch.lags) if batch.lags else 0.0,
            "rollout/staleness_max": max(batch.lags, default=0.0),
            "rollout/stale_dropped": float(batch.counts["stale_dropped"]),
            "rollout/stale_masked": float(batch.counts["stale_masked"]),
            "rollout/groups_zero_variance": float(batch.counts["groups_zero_variance"]),
            "rollout/dropped": float(batch.counts["stale_dropped"] + batch.counts["zero_variance_samples"]),
        }
        for status, n in statuses.items():
            m[f"rollout/sessions_{status}"] = float(n)
        if batch.groups:
            m["perf/gen_s"] = max(g.finished for g in batch.groups) - min(g.started for g in batch.groups)
        for k in sorted({k for g in batch.groups for k in g.metrics}):
            m[f"rollout/env_{k}"] = statistics.fmean(g.metrics.get(k, 0.0) for g in batch.groups)
        return m

    # -- evaluation, checkpoints, report -------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, float]:
        self.waiter.begin(f"held-out evaluation ({tag})")
        ref = self.cluster.rollout.evaluate.remote(
            self.cfg.env.eval_tasks, EVAL_SEED, tag, self.cfg.env.concurrency
        )
        result = self.waiter.get([ref], "generation")[0]
        _print(
            f"eval {tag}: accuracy {result['accuracy']:.3f} on {int(result['tasks'])} held-out tasks "
            f"(greedy, {result['wall_s']:.1f} s)",
            None,
        )
        return result

    def evaluate_teacher(self) -> float | None:
        """The teacher's held-out accuracy, for reference. Runs after the last checkpoint: the
        teacher's weights replace the student's on every engine. Only a megatron-mode teacher has
        the student's architecture; any failure is a warning, never the run's end."""
        cfg = self.cfg
        if cfg.trainer.teacher_mode != "megatron":
            log.info("teacher not evaluated: trainer.teacher_mode is %s", cfg.trainer.teacher_mode)
            return None
        import httpx

        from palaestra.presets import resolve_model

        try:
            path = str(resolve_model(cfg.model.teacher))
            for box in self.cluster.engines:
                r = httpx.post(
                    f"{box.url}/update_weights_from_disk",
                    json={"model_path": path, "weight_version": "teacher"},
                    timeout=cfg.run.step_timeout_s,
                    trust_env=False,
                )
                if r.status_code != 200 or not r.json().get("success", True):
                    raise RuntimeError(f"{box.url}: {r.status_code} {r.text[:200]}")
            return self.evaluate("teacher")["accuracy"]
        except Exception as exc:  # a reference number: report, never fail the finished run
            log.warning("teacher not evaluated: %s", exc)
            return None

    def checkpoint(self) -> None:
        state = self.state
        name = f"step-{state.step:06d}"
        root = self.out / "checkpoints"
        ckpt = root / name
        self.waiter.begin(f"checkpoint {name}")
        self.waiter.get(self.cluster.trainer_call("save", str(ckpt / "trainer")), "saving the trainer")
        save_config(self.cfg, ckpt / "config.yaml")
        (ckpt / "state.json").write_text(json.dumps(asdict(state)) + "\n")
        tmp = root / "latest.tmp"
        tmp.write_text(name + "\n")
        tmp.replace(root / "latest")  # the pointer moves only once the checkpoint is whole

    def report(self, result: RunResult) -> None:
        from palaestra.report import plot_reward_curve, write_trajectory_viewer

        rows = self.state.rows
        result.reward_curve = plot_reward_curve(
            rows,
            self.out / "reward_curve.png",
            title=f"{self.cfg.run.name}: reward per step",
            teacher_accuracy=result.teacher_accuracy,
        )
        if self.last_samples:
            samples = [s.to_dict() for s in self.last_samples[:64]]
            self.waiter.begin("the trajectory viewer")
            teacher = self.waiter.get(
                self.cluster.trainer_call("teacher_logprobs", [], rank0_args=(self.last_samples[:64],)),
                "teacher scoring",
            )[0]
            for s, t in zip(samples, teacher or [], strict=False):
                s["teacher_logprobs"] = t
            from transformers import AutoTokenizer

            from palaestra.presets import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.cfg.model.student))
            result.viewer = write_trajectory_viewer(
                samples,
                tokenizer,
                self.out / "viewer.html",
                title=f"{self.cfg.run.name}: last step's samples",
            )
        rewards = [
            r["rollout/reward_mean"] for r in rows if not math.isnan(r.get("rollout/reward_mean", math.nan))
        ]
        parts = [f"done: {self.state.step} steps ({self.cfg.run.mode})"]
        if rewards:
            parts.append(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")
        before = next((r["eval/accuracy"] for r in rows if "eval/accuracy" in r), None)
        if before is not None and result.eval_after is not None:
            teacher = "" if result.teacher_accuracy is None else f"; teacher {result.teacher_accuracy:.3f}"
            parts.append(
                f"held-out accuracy {before:.3f} -> {result.eval_after['accuracy']:.3f} "
                f"({int(result.eval_after['tasks'])} tasks{teacher})"
            )
        parts.append(
            f"weight version {self.state.weight_version} on {len(result.engine_versions_end)} engines"
        )
        noted = {k: v for k, v in self.counts.items() if v and k != "sessions_completed"}
        if noted:
            parts.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(noted.items())))
        parts.append(f"-> {self.out}/{{reward_curve.png, viewer.html, metrics.jsonl}}")
        result.summary = "; ".join(parts)
        _print(result.summary, None)


def _build_presets(cfg: RunConfig) -> None:
    """Builds the presets the run names (the demo's warm-started teacher and student take ~2 min
    the first time) here, with progress on the console, before any actor asks for them."""
    from palaestra.presets import PRESETS, resolve_model

    for name in dict.fromkeys([cfg.model.student, cfg.model.teacher, cfg.trainer.teacher_model]):
        if name in PRESETS:
            t0 = time.perf_counter()
            path = resolve_model(name)
            log.info("model %s: %s (%.1f s)", name, path, time.perf_counter() - t0)


def _warn_off_policy(cfg: RunConfig) -> None:
    tr = cfg.trainer
    if cfg.run.mode != "sync" and not (tr.keep_old_actor or tr.use_tis or tr.rs_mode):
        log.warning(
            "run.mode=%s trains on samples up to %d version(s) old, but trainer.keep_old_actor, "
            "trainer.use_tis and trainer.rs_mode are all off: the PPO ratio then treats them as "
            "on-policy. keep_old_actor=true fits one_step_off; use_tis=true fits async.",
            cfg.run.mode,
            cfg.run.max_staleness,
        )


def _progress(steps: int, done: int):
    """A progress bar across steps on a terminal (console lines print above it); None otherwise."""
    if not sys.stderr.isatty() or steps == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=done, desc="train", unit="step", dynamic_ncols=True)


def _print(line: str, bar) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------
def _command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("megatron").setLevel(logging.WARNING)  # parameter lists when a model is built
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # only overrides, no file
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    try:
        train(cfg)
    except RunFailed as exc:
        print(f"palaestra train: {exc}", file=sys.stderr)
        return 1
    return 0


def register(groups) -> None:
    p = groups.add_parser(
        "train",
        help="train a policy end to end on Ray (engines, router, gateway, environment, trainer)",
        description="Run RL/OPD training: YAML config plus dotted overrides (section.field=value). "
        "Modes: sync, one_step_off, async (run.mode). Writes runs/<name>/: config.yaml, "
        "metrics.jsonl, tensorboard/, checkpoints/, logs/, reward_curve.png, viewer.html. "
        "See docs/training.md.",
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config (omit to use only defaults)")
    p.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides, e.g. run.steps=10 run.mode=async"
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=_command)
