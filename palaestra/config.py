"""`RunConfig`: the one typed config of a training run, loaded from YAML plus dotted overrides.

    palaestra train run.yaml trainer.megatron_optimizer.lr=1e-5 run.mode=async env.args.difficulty=2

Each section is a dataclass with a docstring under every field (units and sentinel values in
it); `config_help()` prints them all and is `palaestra train --help`'s epilog. Backend options are
never re-declared: `engines.engine` becomes `--<key>` flags of `palaestra engine serve`,
`engines.sglang` `--sglang-<key>` of `palaestra sglang launch`, `router` `--router-<key>` of
`palaestra router serve`, and the trainer's Megatron options live in `TrainerConfig` under
Megatron's own names. Dict-typed fields accept any key; dataclass fields only their own, and a
misspelt one fails with the path and the closest names. `save_config` writes the resolved config
next to every run and checkpoint; it loads back to an equal `RunConfig`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from palaestra.trainer.config import TrainerConfig

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


class ConfigError(ValueError):
    """A config that cannot be loaded: one line per problem, each naming its key path."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


# ----------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------
@dataclass
class ModelOptions:
    """Which weights are trained and which one teaches."""

    student: str = "tiny"
    """The policy being trained: a preset (tiny, smollm2-135m, ...) or a HF-format directory."""

    teacher: str | None = None
    """Teacher for on-policy distillation (preset or HF directory); None = no teacher. Also the
    default of trainer.teacher_model."""


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
class GatewayOptions:
    """The gateway's own options (those of `palaestra gateway serve` a run may tune)."""

    reasoning_policy: Literal["strip", "keep"] = "strip"
    """When the template drops earlier reasoning: strip = fork a new sample, keep = bridge anyway."""

    pause_mode: Literal["wait", "reject"] = "wait"
    """While paused for a weight sync, new calls wait (up to pause_wait_s) or get 429."""

    pause_wait_s: float = 600.0
    """Longest wait of a call while paused, seconds."""

    default_max_tokens: int = 4096
    """Max tokens of a call that sets none (capped by the context length)."""

    context_length: int | None = None
    """Context length in tokens; None = the engine's /server_info."""

    tool_parser: str = "auto"
    """Tool-call parser: auto (from the chat template), hermes, glm45, none, or module:attr."""

    reasoning_parser: str = "auto"
    """Reasoning parser: auto, qwen3, deepseek-r1, glm45, none."""

    engine_timeout_s: float = 600.0
    """Timeout of one engine call, seconds."""

    engine_retries: int = 2
    """Retries of an engine call that committed no tokens (connection refused, 5xx)."""

    def serve_flags(self) -> list[str]:
        """`palaestra gateway serve` arguments (the run adds model, URLs, keys, spool dir)."""
        return to_flags({k: v for k, v in dataclasses.asdict(self).items() if v is not None})


@dataclass
class EnvOptions:
    """The environment that produces the training data."""

    name: str = "math"
    """Built-in environment (math, math-tool) or 'package.module:Class'."""

    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (e.g. difficulty: 2, max_tokens: 256)."""

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

    checkpoint_every: int = 10
    """Steps between checkpoints (each with this config saved beside it); 0 = only the last step."""

    resume: bool = False
    """Resume from the latest checkpoint in the output directory (same data order, weight version)."""

    seed: int = 0
    """Seed of the task order and the rollouts (trainer.seed seeds torch)."""

    step_timeout_s: float = 1800.0
    """A step that takes longer fails the run with a message instead of hanging, seconds."""

    placement: Literal["colocated", "decoupled"] = "colocated"
    """colocated: trainer and engines time-share devices; decoupled: separate devices."""

    host: str = "127.0.0.1"
    """Address every service binds (engines, router, gateway); keep loopback unless on a private network."""


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


def to_flags(options: Mapping[str, Any], prefix: str = "--") -> list[str]:
    """Options as command-line flags: {"tp_size": 2, "enable_x": True, "y": False} -> --tp-size 2 --enable-x.

    True is a bare flag, False and None are left out, a list repeats nothing but its items after
    one flag (argparse's nargs), anything else is str(value). Underscores become hyphens.
    """
    flags: list[str] = []
    for key, value in options.items():
        flag = prefix + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 floats: PyYAML alone reads `1e-5` (no dot) as a string."""


class _Dumper(yaml.SafeDumper):
    """Quotes the strings that _Loader would read as floats, so saved configs load back equal."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: not valid YAML: {exc}"]) from None


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _unknown(path: str, key: str, known: Sequence[str], *, list_known: bool = True) -> str:
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    message = f"{_join(path, key)}: unknown key"
    if close:
        message += f" (did you mean {', '.join(repr(_join(path, c)) for c in close)}?)"
    if list_known:
        message += f"; {path or 'the top level'} has {', '.join(known)}"
    return message


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_text(hint: Any) -> str:
    if hint is Any:
        return "any"
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


class _Mismatch(Exception):
    pass


def _check(value: Any, hint: Any) -> Any:
    """`value` as type `hint` (ints widen to float), or _Mismatch."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _check(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise _Mismatch
    if hint is bool or hint is int or hint is str:
        if type(value) is hint:
            return value
        raise _Mismatch
    if hint is float:
        if type(value) in (int, float):
            return float(value)
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        return [_check(v, args[0]) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch
        return {k: _check(v, args[1]) for k, v in value.items()} if args else dict(value)
    raise TypeError(f"config type {hint!r} is not supported by palaestra.config")


def _mismatch(path: str, value: Any, hint: Any) -> str:
    message = f"{path}: expected {_type_text(hint)}, got {value!r} ({type(value).__name__})"
    choices = [
        a
        for arg in [hint, *typing.get_args(hint)]
        if typing.get_origin(arg) is Literal
        for a in typing.get_args(arg)
    ]
    if isinstance(value, str) and choices:
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return message


def _build(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    """An instance of dataclass `cls` from a mapping: unknown keys and type errors go to `problems`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{path or 'config'}: expected a mapping of {cls.__name__} options, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    ok = True
    for key, value in data.items():
        key_path = _join(path, str(key))
        if key not in names:
            problems.append(_unknown(path, str(key), names))
            ok = False
            continue
        hint = hints[key]
        if _is_dataclass_type(hint):
            built = _build(hint, value, key_path, problems)
            ok = ok and built is not None
            kwargs[key] = built
            continue
        if value is None and typing.get_origin(hint) is dict:
            value = {}  # an empty YAML section (`router:`)
        try:
            kwargs[key] = _check(value, hint)
        except _Mismatch:
            problems.append(_mismatch(key_path, value, hint))
            ok = False
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own __post_init__ checks
        problems.append(f"{path or 'config'}: {exc}")
        return None


def _set_override(raw: dict[str, Any], item: str) -> None:
    """Applies one `a.b.c=value` to the raw mapping, checking the path against the schema."""
    if "=" not in item:
        raise ConfigError([f"override {item!r}: expected key.path=value (e.g. run.steps=10)"])
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError([f"override {item!r}: empty key in {dotted!r}"])
    value = _yaml(text, f"override {dotted}")
    cls: type = RunConfig
    node = raw
    for i, key in enumerate(keys):
        path = ".".join(keys[:i])
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if key not in names:
            raise ConfigError([_unknown(path, key, names)])
        hint = typing.get_type_hints(cls)[key]
        last = i == len(keys) - 1
        if _is_dataclass_type(hint) and not last:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node, cls = child, hint
            continue
        if typing.get_origin(hint) is dict and not last:  # passthrough: any key, nested as given
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            for sub in keys[i + 1 : -1]:
                if not isinstance(child.get(sub), dict):
                    child[sub] = {}
                child = child[sub]
            child[keys[-1]] = value
            return
        if not last:
            raise ConfigError([f"override {item!r}: {_join(path, key)} is {_type_text(hint)}, not a section"])
        if isinstance(value, int | float | bool) and _accepts_str(hint):
            try:
                _check(value, hint)
            except _Mismatch:
                value = text.strip()  # run.name=2024 is the string "2024"
        node[key] = value


def _accepts_str(hint: Any) -> bool:
    return hint is str or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint)
    )


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run's config: defaults, then the YAML file at `path` (if any), then `overrides`.

    Each override is `dotted.key=value`, the value parsed as YAML (1e-5, true, null, [a, b],
    {k: v}). Raises ConfigError naming every unknown key (with close matches), type error and
    violated constraint.
    """
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read: {exc}"]) from None
        raw = _yaml(text, str(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                [f"{path}: expected a mapping of sections at the top, got {type(raw).__name__}"]
            )
    for item in overrides:
        _set_override(raw, item)
    _resolve_teacher(raw)
    _resolve_old_actor(raw)
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    if problems:
        raise ConfigError(problems)
    validate(cfg)
    return cfg


def _resolve_teacher(raw: dict[str, Any]) -> None:
    """trainer.teacher_model defaults to model.teacher, so that one place names the teacher; OPD
    in megatron mode without either fails here with a message that points at model.teacher."""
    model, trainer = raw.get("model"), raw.get("trainer")
    if not isinstance(model, dict | None) or not isinstance(trainer, dict | None):
        return  # reported as type errors by _build
    teacher = (model or {}).get("teacher")
    trainer = raw.setdefault("trainer", {}) if trainer is None else trainer
    if teacher is not None and trainer.get("teacher_model") is None:
        trainer["teacher_model"] = teacher
    opd = trainer.get("opd_kl_coef")
    if (
        isinstance(opd, int | float)
        and opd > 0
        and trainer.get("teacher_mode") == "megatron"
        and trainer.get("teacher_model") is None
    ):
        message = "trainer.opd_kl_coef > 0 (on-policy distillation) needs a teacher: set model.teacher"
        raise ConfigError([f"model.teacher: {message} to a preset or HF directory"])


def _resolve_old_actor(raw: dict[str, Any]) -> None:
    """trainer.keep_old_actor defaults to run.mode == one_step_off: only there did the previous
    step's weights sample the batch (validate() rejects it set true in the other modes)."""
    run, trainer = raw.get("run"), raw.get("trainer")
    if not isinstance(run, dict | None) or not isinstance(trainer, dict | None):
        return  # reported as type errors by _build
    trainer = raw.setdefault("trainer", {}) if trainer is None else trainer
    if trainer.get("keep_old_actor") is None:
        trainer["keep_old_actor"] = (run or {}).get("mode", RunOptions.mode) == "one_step_off"


def validate(cfg: RunConfig) -> None:
    """Cross-field constraints (types are checked while loading). Raises ConfigError listing all."""
    problems: list[str] = []
    tr, env, run = cfg.trainer, cfg.env, cfg.run

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(cfg.engines.count >= 1, f"engines.count: need at least 1 engine, got {cfg.engines.count}")
    need(env.tasks_per_step >= 1, f"env.tasks_per_step: must be >= 1, got {env.tasks_per_step}")
    need(env.concurrency >= 1, f"env.concurrency: must be >= 1, got {env.concurrency}")
    need(env.eval_tasks >= 0 and env.eval_every >= 0, "env.eval_tasks and env.eval_every must be >= 0")
    need(
        env.samples_per_task >= 2 or (env.samples_per_task == 1 and tr.opd_kl_coef > 0),
        f"env.samples_per_task: {env.samples_per_task}, but trainer.advantage_estimator "
        f"{tr.advantage_estimator!r} baselines each reward on its group's mean, so a group needs >= 2 "
        "samples (1 is allowed only for pure OPD, trainer.opd_kl_coef > 0)",
    )
    need(
        not env.filter_zero_variance_groups or env.samples_per_task >= 2,
        "env.filter_zero_variance_groups: a group of 1 sample always has zero variance; "
        "need env.samples_per_task >= 2",
    )
    need(run.steps >= 0, f"run.steps: must be >= 0, got {run.steps}")
    need(run.max_staleness >= 0, f"run.max_staleness: must be >= 0, got {run.max_staleness}")
    need(
        not tr.keep_old_actor or run.mode == "one_step_off",
        f"trainer.keep_old_actor: true scores each batch with the previous step's weights, which "
        f"sampled it only in run.mode=one_step_off (in {run.mode!r} mode "
        + ("the current weights sampled it" if run.mode == "sync" else "the lag varies: use trainer.use_tis")
        + "); leave it unset to follow run.mode",
    )
    need(
        run.mode == "sync" or run.max_staleness >= 1,
        f"run.max_staleness: mode {run.mode!r} trains on samples at least one weight version old; "
        "need max_staleness >= 1",
    )
    need(run.checkpoint_every >= 0, f"run.checkpoint_every: must be >= 0, got {run.checkpoint_every}")
    need(run.step_timeout_s > 0, f"run.step_timeout_s: must be > 0, got {run.step_timeout_s}")
    need(
        bool(run.name) and "/" not in run.name and run.name not in (".", ".."),
        f"run.name: {run.name!r} must be a non-empty file name (no '/')",
    )
    need(cfg.logging.console_every >= 1, "logging.console_every: must be >= 1")
    need(
        cfg.model.teacher is None or tr.teacher_model in (None, cfg.model.teacher),
        f"trainer.teacher_model {tr.teacher_model!r} disagrees with model.teacher "
        f"{cfg.model.teacher!r}; set only model.teacher",
    )
    need(
        cfg.engines.backend != "sglang" or tr.sync_mode == "disk",
        "trainer.sync_mode: SGLang servers read weights from disk (their tensor API takes CUDA IPC "
        "handles); set trainer.sync_mode=disk and trainer.sync_dir",
    )
    need(
        tr.sync_mode != "disk" or bool(tr.sync_dir),
        "trainer.sync_dir: sync_mode 'disk' needs a directory every engine can read",
    )
    problems += _owned("engines.engine", cfg.engines.engine, OWNED_ENGINE_OPTIONS, "the run sets it")
    problems += _owned("engines.sglang", cfg.engines.sglang, OWNED_SGLANG_OPTIONS, "the run sets it")
    problems += _owned("router", cfg.router, OWNED_ROUTER_OPTIONS, "the run sets it (consistent_hashing)")
    if not problems:
        problems += _check_with_parser("engines.engine", cfg.engines.serve_flags(), _engine_parser(), "--")
        problems += _check_with_parser("router", cfg.router_flags(), _router_parser(), "--router-")
    if problems:
        raise ConfigError(problems)


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
            problems.append(_unknown(path, name, sorted(known), list_known=False))

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
    path.write_text(
        header + yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    )
    return path


def _field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the class source: Python drops attribute docstrings at runtime."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                doc = inspect.cleandoc(str(after.value.value))
            docs[node.target.id] = doc
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def config_help() -> str:
    """Every option as `section.field: type = default` with its docstring (`palaestra train --help`)."""
    lines = [
        "Config options: YAML sections below, or overrides `section.field=value` after the config",
        "file (values are YAML: 1e-5, true, null, [a, b], {k: v}). Fields typed dict pass through",
        "under the backend's own option names and accept any key.",
        "",
    ]

    def walk(cls: type, prefix: str, depth: int) -> None:
        docs, hints = _field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = _join(prefix, f.name)
            doc = docs.get(f.name, "")
            indent = "  " * depth
            if _is_dataclass_type(hints[f.name]):
                lines.append(f"{indent}{path}: {doc or hints[f.name].__name__}")
                walk(hints[f.name], path, depth + 1)
                lines.append("")
                continue
            lines.append(f"{indent}{path}: {_type_text(hints[f.name])} = {_show(_default(f))}")
            for line in (doc or "(undocumented)").splitlines():
                lines.append(f"{indent}    {line}")
            if depth == 0:
                lines.append("")

    walk(RunConfig, "", 0)
    return "\n".join(lines).rstrip() + "\n"
