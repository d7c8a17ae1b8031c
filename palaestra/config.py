"""`RunConfig`: the one typed config of a training run, loaded from YAML plus dotted overrides.

    palaestra train run.yaml trainer.megatron_optimizer.lr=1e-5 run.mode=async env.args.difficulty=2

Each section is a dataclass with a docstring under every field (units and sentinel values in
it); `config_help()` prints them all and is `palaestra train --help`'s epilog. Backend options are
never re-declared: `engines.engine` becomes `--<key>` flags of `palaestra engine serve`,
`engines.sglang` `--sglang-<key>` of `palaestra sglang launch`, `router` `--router-<key>` of
`palaestra router serve`, `gateway` is the gateway's own `GatewayOptions` (gateway/options.py),
and the trainer's Megatron options live in `TrainerConfig` under Megatron's own names. Dict-typed
fields accept any key; dataclass fields only their own, and a misspelt one fails with the path and
the closest names. `save_config` writes the resolved config next to every run and checkpoint; it
loads back to an equal `RunConfig`.

Checked when the config loads, before anything starts: `env.args` against the environment's
constructor (unknown and missing keys named, and for each whether it came from the file or an
override: `env.name=code` on configs/demo.yaml keeps the file's math arguments, and the override
`env.args=null` drops them), and the teacher: `model.teacher=null` turns on-policy distillation
off (trainer.opd.kl_coef 0, no opd.teacher_mode), said in one log line.

This file is the schema and its validation; reading YAML, overrides, type checks and help text
are the generic machinery of `palaestra.typed_config`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import logging
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from palaestra.gateway.options import GatewayOptions
from palaestra.trainer.config import TrainerConfig
from palaestra.typed_config import (
    ConfigError,
    apply_override,
    build,
    dump_yaml,
    options_help,
    read_mapping,
    to_flags,
    unknown_key,
)

log = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "EngineOptions",
    "EnvOptions",
    "GatewayOptions",
    "LoggingOptions",
    "ModelOptions",
    "RunConfig",
    "RunOptions",
    "config_help",
    "config_to_dict",
    "load_config",
    "save_config",
    "to_flags",
    "validate",
]


# ----------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------
@dataclass
class ModelOptions:
    """Which weights are trained and which one teaches."""

    student: str = "tiny"
    """The policy being trained: a preset (tiny, smollm2-135m, ...) or a HF-format directory."""

    teacher: str | None = None
    """Teacher for on-policy distillation (preset or HF directory); also the default of
    trainer.opd.teacher_model. null = no teacher: set explicitly (`model.teacher=null`), it also turns
    distillation off (trainer.opd.kl_coef 0, trainer.opd.teacher_mode null), so one override takes
    the teacher out of a config that has one."""


@dataclass
class EngineOptions:
    """The inference engines behind the router."""

    backend: Literal["embedded", "sglang"] = "embedded"
    """embedded: `palaestra engine serve` (CPU, SGLang's HTTP API); sglang: real SGLang servers."""

    count: int = 2
    """Number of engine servers (data-parallel replicas behind the router)."""

    engine: dict[str, Any] = field(default_factory=dict)
    """embedded backend: `palaestra engine serve` options, each key becoming `--<key>` (e.g.
    num_threads: 1, max_running_requests: 32). model, host, port and weight_version are the run's."""

    sglang: dict[str, Any] = field(default_factory=dict)
    """sglang backend: SGLang's own options, each key becoming `--sglang-<key>` (e.g. tp_size: 2,
    mem_fraction_static: 0.8). model_path, host and port are the run's."""

    def serve_flags(self) -> list[str]:
        """`palaestra engine serve` arguments from `engine` (the run adds --model/--host/--port)."""
        return to_flags(self.engine)

    def sglang_flags(self) -> list[str]:
        """`palaestra sglang launch` passthrough arguments from `sglang`."""
        return to_flags(self.sglang, "--sglang-")


@dataclass
class EnvOptions:
    """The environment that produces the training data."""

    name: str = "math"
    """A built-in environment (the names below) or 'package.module:Class' (a module in the working
    directory or on PYTHONPATH)."""

    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (e.g. difficulty: 2, max_tokens: 256),
    checked against it when the config loads. Changing env.name keeps the file's args:
    `env.args=null` (or {}) drops them, `env.args={k: v}` replaces them."""

    tasks_per_step: int = 8
    """Tasks per training step; each becomes one group of samples_per_task sessions."""

    samples_per_task: int = 4
    """Sessions per task (the GRPO group). 1 only with OPD: a group of one has advantage 0."""

    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (no RL signal); the drops are counted."""

    concurrency: int = 16
    """Sessions in flight at once."""

    eval_tasks: int = 64
    """Held-out tasks scored before and after training (and every eval_every steps); 0 = none."""

    eval_every: int = 0
    """Steps between held-out evaluations during training; 0 = only before and after."""

    eval_teacher: bool = True
    """With a megatron-mode teacher (model.teacher), score it on the same held-out tasks once
    training is over (its weights replace the student's on the engines after the last checkpoint),
    for the reward curve's reference line and the summary."""


@dataclass
class RunOptions:
    """The run as a whole: length, mode, checkpoints, placement."""

    name: str = "run"
    """Run name: the default output directory is runs/<name>."""

    output_dir: str | None = None
    """Where the run writes config, checkpoints, logs and reports; None = runs/<name>."""

    steps: int = 20
    """Training steps (one optimizer step and one weight sync each); 0 = evaluate only."""

    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """sync: generate, train, sync. one_step_off: generate step k+1 while training step k.
    async: generate continuously; samples older than max_staleness are dropped or masked."""

    max_staleness: int = 1
    """Most weight versions a trained sample may lag the trainer (one_step_off and async need >= 1)."""

    stale_policy: Literal["drop", "mask"] = "drop"
    """Samples beyond max_staleness: drop = discard them, mask = keep them with loss_mask zeroed.
    Either way they are counted."""

    partial_rollouts: bool = True
    """async: a weight sync interrupts the engines' generations in flight (SGLang's pause-abort) and
    the gateway continues each from its last token with the new weights, so a sync never waits for a
    long answer (each token keeps the version that sampled it). false: the gateway drains its calls
    in flight before the sync (trainer.sync.pause_mode then applies)."""

    checkpoint_every: int = 10
    """Steps between checkpoints (each with this config saved beside it); 0 = only the last step."""

    resume: bool = False
    """Resume from the latest checkpoint in the output directory (same data order, weight version)."""

    seed: int = 0
    """Seed of the task order and the rollouts (trainer.seed seeds torch)."""

    step_timeout_s: float = 1800.0
    """A step that takes longer fails the run with a message instead of hanging, seconds."""

    max_restarts: int = 3
    """Times the driver restarts or replaces each component (an engine, the router, the gateway, the
    environment runner, the trainer) after its process died; one death more fails the run, naming
    the component and its log tail. 0 = any death fails the run (docs/reliability-faults.md)."""

    placement: Literal["colocated", "decoupled"] = "colocated"
    """colocated: trainer and engines time-share devices; decoupled: separate devices."""

    host: str = "127.0.0.1"
    """Address every service binds (engines, router, gateway); keep loopback unless on a private network."""

    ray_address: str | None = None
    """Ray cluster to join instead of starting a local Ray: "auto" (the cluster this node belongs
    to, `ray start`), "HOST:6379" (its head node) or "ray://HOST:10001" (Ray client). None = the
    RAY_ADDRESS environment variable if set, else a local Ray bound to `host`. On a cluster set
    `host: 0.0.0.0` (services advertise their node's address) and see docs/training.md for ports."""

    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    """Ray resources each kind of box asks for, to choose its nodes: keys `trainer` (per trainer
    rank), `engines` (per engine) and `services` (router, gateway, environment runner), values
    Ray resource demands such as {"trainer_node": 1} for a custom resource given to nodes with
    `ray start --resources='{"trainer_node": 4}'`. Added to the CPU/GPU bundles `placement` makes."""


@dataclass
class LoggingOptions:
    """Where metrics go (keys are namespaced: rollout/, train/, opd/, mismatch/, perf/)."""

    console_every: int = 1
    """Steps between console lines."""

    tensorboard_dir: str | None = "tensorboard"
    """TensorBoard directory, relative to the output directory; None = no TensorBoard."""

    wandb_project: str | None = None
    """Weights & Biases project; None = no W&B."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode when wandb_project is set (offline writes locally; `wandb sync` uploads later)."""


@dataclass
class RunConfig:
    """Everything a training run needs."""

    model: ModelOptions = field(default_factory=ModelOptions)
    """Which weights are trained and which one teaches."""

    engines: EngineOptions = field(default_factory=EngineOptions)
    """The inference engines behind the router: backend, count, their own options."""

    router: dict[str, Any] = field(default_factory=dict)
    """sglang-router options, each key becoming `--router-<key>` (e.g. health_check_interval_secs: 1).
    The policy (consistent_hashing), host, ports and log level are the run's."""

    gateway: GatewayOptions = field(default_factory=GatewayOptions)
    """The gateway's own options (model, engine URL, keys and spool are set by the run)."""

    env: EnvOptions = field(default_factory=EnvOptions)
    """The environment: which one, its arguments, tasks and groups per step, held-out evaluation."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The Megatron trainer (palaestra.trainer.config.TrainerConfig; Megatron's options inside it)."""

    run: RunOptions = field(default_factory=RunOptions)
    """The run as a whole: length, mode, staleness, checkpoints, seed, placement."""

    logging: LoggingOptions = field(default_factory=LoggingOptions)
    """Where metrics go (keys are namespaced: rollout/, train/, opd/, mismatch/, perf/)."""

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir or f"runs/{self.run.name}")

    def router_flags(self) -> list[str]:
        """`palaestra router serve` passthrough arguments from `router`."""
        return to_flags(self.router, "--router-")


# Options of the backends that the run sets itself (so that the two can never disagree).
OWNED_ENGINE_OPTIONS = {"model", "host", "port", "weight_version"}
OWNED_SGLANG_OPTIONS = {"model_path", "model", "host", "port", "weight_version"}
OWNED_ROUTER_OPTIONS = {
    "policy",
    "host",
    "port",
    "prometheus_host",
    "prometheus_port",
    "log_level",
    "worker_urls",
}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run's config: defaults, then the YAML file at `path` (if any), then `overrides`.

    Each override is `dotted.key=value`, the value parsed as YAML (1e-5, true, null, [a, b],
    {k: v}). Raises ConfigError naming every unknown key (with close matches), type error and
    violated constraint, `env.args` keys the environment does not take among them (each said to
    come from the file or an override).
    """
    from_file = read_mapping(RunConfig, path)  # an old flat trainer key moved to its section here
    overridden = read_mapping(RunConfig, None, overrides)  # the overrides alone: what they set
    raw = copy.deepcopy(from_file)
    for item in overrides:
        apply_override(RunConfig, raw, item)
    _resolve_teacher(raw)
    _resolve_old_actor(raw)
    cfg = build(RunConfig, raw)
    validate(cfg, env_args_from=_args_origin(path, from_file, overridden))
    return cfg


@dataclass(frozen=True)
class ArgsOrigin:
    """Where a run's `env.args` keys were set, for the errors that name them (`load_config`)."""

    file: str | None
    """The config file, or None."""
    file_env: str
    """The environment the file names (its env.name, else the default)."""
    overridden: frozenset[str]
    """The env.args keys set by an override (`env.args.k=v`, or `env.args={...}`)."""

    def of(self, key: str) -> str:
        return "an override" if key in self.overridden or self.file is None else self.file


def _args_origin(
    path: str | Path | None, from_file: Mapping[str, Any], overridden: Mapping[str, Any]
) -> ArgsOrigin:
    def env_of(raw: Mapping[str, Any]) -> dict[str, Any]:
        env = raw.get("env")
        return env if isinstance(env, dict) else {}

    args = env_of(overridden).get("args")
    return ArgsOrigin(
        None if path is None else str(path),
        str(env_of(from_file).get("name", EnvOptions.name)),
        frozenset(args) if isinstance(args, dict) else frozenset(),
    )


def _resolve_teacher(raw: dict[str, Any]) -> None:
    """trainer.opd.teacher_model defaults to model.teacher, so that one place names the teacher.

    `model.teacher: null`, set explicitly, is the one switch that turns the teacher off: with no
    other teacher given (trainer.opd.teacher_model, a teachers panel, or sglang teacher_urls), OPD
    goes off with it (opd.kl_coef 0, opd.teacher_mode null), said in one log line. OPD in megatron
    mode with no teacher anywhere fails here, saying how to turn the teacher on and how to turn it
    off. Runs after `move_renamed`: the trainer's old flat keys are in `opd` by now."""
    model, trainer = raw.get("model"), raw.get("trainer")
    if not isinstance(model, dict | None) or not isinstance(trainer, dict | None):
        return  # reported as type errors by build()
    if trainer is not None and not isinstance(trainer.get("opd"), dict | None):
        return  # reported as a type error by build()
    model = model or {}
    teacher = model.get("teacher")
    trainer = raw.setdefault("trainer", {}) if trainer is None else trainer
    opd = trainer.setdefault("opd", {}) if trainer.get("opd") is None else trainer["opd"]
    if teacher is not None and opd.get("teacher_model") is None:
        opd["teacher_model"] = teacher
    coef = opd.get("kl_coef")
    wants_opd = isinstance(coef, int | float) and not isinstance(coef, bool) and coef > 0
    mode = opd.get("teacher_mode")
    no_other_teacher = opd.get("teacher_model") is None and mode != "sglang" and not opd.get("teachers")
    if "teacher" in model and teacher is None and no_other_teacher and (wants_opd or mode is not None):
        opd["kl_coef"], opd["teacher_mode"] = 0.0, None
        log.info(
            "model.teacher=null: no teacher, on-policy distillation off (trainer.opd.kl_coef %s -> 0, "
            "trainer.opd.teacher_mode %s -> null)",
            coef if coef is not None else 0,
            mode,
        )
    elif mode == "megatron" and opd.get("teacher_model") is None:
        needs = (
            "trainer.opd.kl_coef > 0 (on-policy distillation, teacher_mode megatron)"
            if wants_opd
            else "trainer.opd.teacher_mode megatron"
        )
        raise ConfigError(
            [
                f"model.teacher: {needs} needs a teacher: set model.teacher to a preset or HF "
                "directory, or train without one: model.teacher=null (turns distillation off)"
            ]
        )


def _resolve_old_actor(raw: dict[str, Any]) -> None:
    """trainer.keep_old_actor defaults to run.mode == one_step_off: only there did the previous
    step's weights sample the batch (validate() rejects it set true in the other modes)."""
    run, trainer = raw.get("run"), raw.get("trainer")
    if not isinstance(run, dict | None) or not isinstance(trainer, dict | None):
        return  # reported as type errors by build()
    trainer = raw.setdefault("trainer", {}) if trainer is None else trainer
    if trainer.get("keep_old_actor") is None:
        trainer["keep_old_actor"] = (run or {}).get("mode", RunOptions.mode) == "one_step_off"


def validate(cfg: RunConfig, env_args_from: ArgsOrigin | None = None) -> None:
    """Cross-field constraints (types are checked while loading), `env.args` against the
    environment's constructor among them. Raises ConfigError listing all.

    `env_args_from` says where each `env.args` key was set (the file or an override, as
    `load_config` knows), so that an error can say which keys to drop and how."""
    problems = _Problems()
    _check_rollouts(cfg, problems.need)
    _check_run(cfg, problems.need)
    _check_training(cfg, problems.need)
    if cfg.trainer.lora.enabled:  # the engines must serve it: found at config load, not minutes later
        _check_lora_serving(cfg, problems.need)
    problems += _env_arg_problems(cfg.env, env_args_from)
    problems += _owned("engines.engine", cfg.engines.engine, OWNED_ENGINE_OPTIONS, "the run sets it")
    problems += _owned("engines.sglang", cfg.engines.sglang, OWNED_SGLANG_OPTIONS, "the run sets it")
    problems += _owned("router", cfg.router, OWNED_ROUTER_OPTIONS, "the run sets it (consistent_hashing)")
    if not problems:
        problems += _check_with_parser("engines.engine", cfg.engines.serve_flags(), _engine_parser(), "--")
        problems += _check_with_parser("router", cfg.router_flags(), _router_parser(), "--router-")
    if problems:
        raise ConfigError(list(problems))


class _Problems(list):
    """The problems found so far; `need(ok, message)` adds `message` when `ok` is false."""

    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)


_Need = Callable[[bool, str], None]


def _check_rollouts(cfg: RunConfig, need: _Need) -> None:
    """What a step samples: engines, tasks, groups."""
    tr, env = cfg.trainer, cfg.env
    need(cfg.engines.count >= 1, f"engines.count: need at least 1 engine, got {cfg.engines.count}")
    need(env.tasks_per_step >= 1, f"env.tasks_per_step: must be >= 1, got {env.tasks_per_step}")
    need(env.concurrency >= 1, f"env.concurrency: must be >= 1, got {env.concurrency}")
    need(env.eval_tasks >= 0 and env.eval_every >= 0, "env.eval_tasks and env.eval_every must be >= 0")
    need(
        env.samples_per_task >= 2 or (env.samples_per_task == 1 and tr.opd.kl_coef > 0),
        f"env.samples_per_task: {env.samples_per_task}, but trainer.advantage_estimator "
        f"{tr.advantage_estimator!r} baselines each reward on its group's mean, so a group needs >= 2 "
        "samples (1 is allowed only for pure OPD, trainer.opd.kl_coef > 0)",
    )
    need(
        not env.filter_zero_variance_groups or env.samples_per_task >= 2,
        "env.filter_zero_variance_groups: a group of 1 sample always has zero variance; "
        "need env.samples_per_task >= 2",
    )
    ds = tr.dynamic_sampling
    need(
        not ds.enabled or not tr.rewards_train or env.samples_per_task >= 2,
        "trainer.dynamic_sampling.enabled: a group of 1 sample always has zero variance, so every "
        "group would be dropped; need env.samples_per_task >= 2",
    )
    need(
        not ds.enabled or cfg.run.mode != "one_step_off",
        "trainer.dynamic_sampling.enabled: run.mode one_step_off trains each batch with the previous "
        "step's weights as the old policy, and refilled groups would be sampled by newer ones; use "
        "run.mode sync or async",
    )


def _check_run(cfg: RunConfig, need: _Need) -> None:
    """The run's loop: steps, staleness per mode, checkpoints, timeouts, its name, its resources."""
    tr, run = cfg.trainer, cfg.run
    need(run.steps >= 0, f"run.steps: must be >= 0, got {run.steps}")
    need(run.max_staleness >= 0, f"run.max_staleness: must be >= 0, got {run.max_staleness}")
    need(
        not tr.keep_old_actor or run.mode == "one_step_off",
        f"trainer.keep_old_actor: true scores each batch with the previous step's weights, which "
        f"sampled it only in run.mode=one_step_off (in {run.mode!r} mode "
        + (
            "the current weights sampled it"
            if run.mode == "sync"
            else "the lag varies: use trainer.tis.enabled"
        )
        + "); leave it unset to follow run.mode",
    )
    need(
        run.mode == "sync" or run.max_staleness >= 1,
        f"run.max_staleness: mode {run.mode!r} trains on samples at least one weight version old; "
        "need max_staleness >= 1",
    )
    need(run.checkpoint_every >= 0, f"run.checkpoint_every: must be >= 0, got {run.checkpoint_every}")
    need(run.step_timeout_s > 0, f"run.step_timeout_s: must be > 0, got {run.step_timeout_s}")
    need(run.max_restarts >= 0, f"run.max_restarts: must be >= 0, got {run.max_restarts}")
    need(
        bool(run.name) and "/" not in run.name and run.name not in (".", ".."),
        f"run.name: {run.name!r} must be a non-empty file name (no '/')",
    )
    need(cfg.logging.console_every >= 1, "logging.console_every: must be >= 1")
    need(
        set(run.resources) <= {"trainer", "engines", "services"},
        f"run.resources: keys must be trainer, engines, services; got {sorted(run.resources)}",
    )
    need(
        all(isinstance(v, (int, float)) and v >= 0 for d in run.resources.values() for v in d.values()),
        "run.resources: every demand must be a number >= 0",
    )


def _check_training(cfg: RunConfig, need: _Need) -> None:
    """The teacher, data parallelism and how weights reach the engines."""
    tr = cfg.trainer
    need(
        cfg.model.teacher is None or tr.opd.teacher_model in (None, cfg.model.teacher),
        f"trainer.opd.teacher_model {tr.opd.teacher_model!r} disagrees with model.teacher "
        f"{cfg.model.teacher!r}; set only model.teacher",
    )
    need(
        cfg.engines.backend != "sglang" or tr.sync.mode != "tensor",
        "trainer.sync.mode: SGLang's /update_weights_from_tensor takes CUDA IPC handles, not bytes; use "
        "shm (same host), ipc (colocated GPUs), distributed (other GPUs or nodes) or disk",
    )
    need(tr.dp_size >= 1, f"trainer.dp_size: must be >= 1, got {tr.dp_size}")
    need(
        tr.sync.mode != "disk" or bool(tr.sync.dir),
        "trainer.sync.dir: sync.mode 'disk' needs a directory every engine can read",
    )


def _check_lora_serving(cfg: RunConfig, need: _Need) -> None:
    """A LoRA run: the engines must serve an adapter of the trained rank."""
    tr = cfg.trainer
    section = "engines.engine" if cfg.engines.backend == "embedded" else "engines.sglang"
    given = cfg.engines.engine if cfg.engines.backend == "embedded" else cfg.engines.sglang
    need(
        given.get("enable_lora", True) not in (False, "false"),
        f"{section}.enable_lora: false, but trainer.lora.rank {tr.lora.rank} trains an adapter the "
        f"engines must serve; drop {section}.enable_lora (the run turns it on) or set trainer.lora.rank=0",
    )
    max_rank = given.get("max_lora_rank")
    need(
        not isinstance(max_rank, int) or max_rank >= tr.lora.rank,
        f"{section}.max_lora_rank {max_rank} is below trainer.lora.rank {tr.lora.rank}; raise it or "
        "drop it (the run sets it to the rank)",
    )


def _env_arg_problems(env: EnvOptions, origin: ArgsOrigin | None) -> list[str]:
    """`env.args` checked against the constructor of the environment `env.name` (imported, not
    built): keys it does not take and arguments it needs, each unknown key with where it came from.

    `temperature` is left out: the run takes it out of env.args (it may only repeat
    trainer.temperature, which reaches the environment in `session.sampling`)."""
    from palaestra.plugins import PluginError
    from palaestra.sdk.registry import environment_arguments, environment_class

    try:
        cls = environment_class(env.name)
    except PluginError as exc:
        return [f"env.name: {exc}"]
    takes = environment_arguments(cls)
    args = {k: v for k, v in env.args.items() if k != "temperature"}
    what = f"environment {env.name!r} ({cls.__module__}:{cls.__qualname__}, which takes {takes.signature()})"
    unknown = takes.unknown(args)
    problems = []
    for key in unknown:
        close = difflib.get_close_matches(key, takes.accepted, n=2, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        source = f" (set in {origin.of(key)})" if origin is not None else ""
        problems.append(f"env.args.{key}: not an argument of {what}{hint}{source}")
    from_file = [k for k in unknown if origin is not None and origin.of(k) == origin.file]
    if from_file and origin is not None and origin.file_env != env.name:
        problems.append(
            f"env.args: {', '.join(from_file)} came from {origin.file}, whose env.name is "
            f"{origin.file_env!r}; an override of env.name keeps the file's env.args: drop them with "
            "the override env.args=null, or replace them with env.args={key: value, ...}"
        )
    for key in takes.missing(args):
        problems.append(f"env.args.{key}: {what} needs it (no default); set env.args.{key}=...")
    if not problems:
        problems += _build_problems(cls, args, what)
    return problems


def _build_problems(cls: type, args: dict[str, Any], what: str) -> list[str]:
    """The environment built with `args`, as the environment runner will build it: a value it
    refuses (an unknown dataset or game, a dataset that fails to build) is reported now, with its
    message, before anything starts. Constructors are cheap by contract (tasks come later)."""
    try:
        cls(**args)
    except Exception as exc:
        return [f"env.args: {what} could not be built with {args!r}: {type(exc).__name__}: {exc}"]
    return []


def _owned(path: str, options: Mapping[str, Any], owned: set[str], why: str) -> list[str]:
    return [f"{path}.{k}: not accepted, {why}" for k in options if k.replace("-", "_") in owned]


def _engine_parser() -> argparse.ArgumentParser:
    from palaestra.engine.cli import add_serve_arguments

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    add_serve_arguments(parser)
    for action in parser._actions:  # --model is the run's; make it optional for this check
        action.required = False
    return parser


def _router_parser() -> argparse.ArgumentParser:
    from palaestra.engine.router import passthrough_parser

    return passthrough_parser()


def _check_with_parser(
    path: str, flags: list[str], parser: argparse.ArgumentParser, prefix: str
) -> list[str]:
    """Checks passthrough options with the backend's own argument parser (names and values)."""
    known = {
        s[len(prefix) :].replace("-", "_")
        for action in parser._actions
        for s in action.option_strings
        if s.startswith(prefix)
    }
    problems = []
    for flag in flags:
        name = flag[len(prefix) :].replace("-", "_") if flag.startswith(prefix) else None
        if name is not None and name not in known:
            problems.append(unknown_key(path, name, sorted(known), list_known=False))

    def fail(message: str) -> typing.NoReturn:
        raise argparse.ArgumentError(None, message)

    parser.error = fail  # type: ignore[method-assign]  # argparse exits on some errors otherwise
    if not problems:
        try:
            _, rest = parser.parse_known_args(flags)
        except argparse.ArgumentError as exc:
            return [f"{path}: {exc}"]
        if rest:
            problems.append(f"{path}: not understood: {' '.join(rest)}")
    return problems


# ----------------------------------------------------------------------------------------------
# Saving and help
# ----------------------------------------------------------------------------------------------
def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain dicts, lists and scalars (what `save_config` writes)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Writes the resolved config as YAML; `load_config(path)` gives back an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# palaestra run config, resolved (defaults + file + overrides); load with load_config\n"
    path.write_text(header + dump_yaml(config_to_dict(cfg)))
    return path


def config_help() -> str:
    """Every option as `section.field: type = default` with its docstring (`palaestra train --help`)."""
    intro = [
        "Config options: YAML sections below, or overrides `section.field=value` after the config",
        "file (values are YAML: 1e-5, true, null, [a, b], {k: v}). Fields typed dict pass through",
        "under the backend's own option names and accept any key.",
        "",
    ]
    from palaestra.sdk.registry import builtin_names

    notes = {"env.name": f"built-in: {builtin_names()}"}  # from the registry, never a copy of it
    return options_help(RunConfig, intro, notes)
