"""`palaestra.config` (on `palaestra.typed_config`): YAML + dotted overrides, passthrough dicts, errors that
name the key, round trip, help; the gateway section is the gateway's own `GatewayOptions`."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from pathlib import Path

import pytest

from palaestra.config import (
    ConfigError,
    EngineOptions,
    EnvOptions,
    GatewayOptions,
    LoggingOptions,
    ModelOptions,
    RunConfig,
    RunOptions,
    config_help,
    config_to_dict,
    load_config,
    save_config,
    to_flags,
    validate,
)
from palaestra.sdk import Environment, Task
from palaestra.trainer.config import (
    RENAMED,
    OpdOptions,
    SnapshotOptions,
    SyncOptions,
    TisOptions,
    TrainerConfig,
)
from palaestra.trainer.config import SECTIONS as TRAINER_SECTIONS
from palaestra.typed_config import field_docs

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"

YAML = """
model:
  student: tiny
  teacher: tiny
engines:
  count: 2
  engine: {num_threads: 1, max_running_requests: 32}
router:
  health_check_interval_secs: 1
gateway:
  pause_mode: reject
env:
  name: math
  args: {difficulty: 1}
  samples_per_task: 4
trainer:
  opd: {kl_coef: 0.5, teacher_mode: megatron}
  megatron: {tensor_model_parallel_size: 1}
  megatron_optimizer: {lr: 1e-5}
run:
  name: demo
  steps: 3
logging:
  tensorboard_dir: null
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    return path


def error_of(path, overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_are_valid_and_complete():
    cfg = load_config(None, [])
    assert cfg == RunConfig()
    validate(cfg)
    assert cfg.output_dir.as_posix() == "runs/run"
    assert isinstance(cfg.trainer, TrainerConfig)


def test_yaml_and_overrides(config_file):
    cfg = load_config(
        config_file,
        [
            "trainer.megatron_optimizer.lr=2e-5",  # 2e-5 without a dot is a float (YAML 1.2), not a string
            "run.mode=async",
            "env.args.difficulty=2",
            "env.args.max_tokens=128",
            "run.name=2024",  # a str field keeps the text
            "trainer.eps_clip_high=0.28",
            "trainer.opd.teacher_urls=[http://127.0.0.1:1, http://127.0.0.1:2]",
            "logging.wandb_project=palaestra",
        ],
    )
    assert (
        cfg.model.teacher == "tiny" and cfg.trainer.opd.teacher_model == "tiny"
    )  # defaulted from model.teacher
    assert cfg.trainer.megatron_optimizer["lr"] == 2e-5
    assert cfg.trainer.megatron_optimizer["clip_grad"] == 1.0  # TrainerConfig's own defaults merged under
    assert cfg.trainer.megatron == {"tensor_model_parallel_size": 1}
    assert cfg.run.mode == "async" and cfg.run.name == "2024" and cfg.run.steps == 3
    assert cfg.env.args == {"difficulty": 2, "max_tokens": 128}
    assert cfg.trainer.eps_clip_high == 0.28
    assert cfg.trainer.opd.teacher_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cfg.gateway.pause_mode == "reject"
    assert cfg.logging.tensorboard_dir is None and cfg.logging.wandb_project == "palaestra"
    assert cfg.output_dir.as_posix() == "runs/2024"


def test_ints_widen_to_float_and_overrides_create_nested_dict_keys():
    cfg = load_config(
        None, ["trainer.kl.coef=1", "trainer.megatron.moe.router_topk=2", "run.output_dir=/tmp/x"]
    )
    assert cfg.trainer.kl.coef == 1.0 and isinstance(cfg.trainer.kl.coef, float)
    assert cfg.trainer.megatron == {"moe": {"router_topk": 2}}
    assert cfg.output_dir.as_posix() == "/tmp/x"


def test_passthrough_dicts_become_native_flags(config_file):
    cfg = load_config(config_file, ["engines.sglang.tp_size=2", "engines.sglang.enable_memory_saver=true"])
    assert cfg.engines.serve_flags() == ["--num-threads", "1", "--max-running-requests", "32"]
    assert cfg.engines.sglang_flags() == ["--sglang-tp-size", "2", "--sglang-enable-memory-saver"]
    assert cfg.router_flags() == ["--router-health-check-interval-secs", "1"]
    flags = cfg.gateway.serve_flags()
    assert flags[flags.index("--pause-mode") + 1] == "reject"
    assert "--context-length" not in flags  # None = left to the gateway
    assert to_flags({"a_b": False, "c": None, "d": [1, 2]}, "--x-") == ["--x-d", "1", "2"]


def test_a_lora_run_starts_its_engines_with_lora_and_its_gateway_naming_the_adapter(config_file):
    from palaestra.orchestrator.cluster import lora_engine_flags, lora_gateway_flags

    assert (
        lora_engine_flags(load_config(config_file, []))
        == []
        == lora_gateway_flags(load_config(config_file, []))
    )
    cfg = load_config(config_file, ["trainer.lora.rank=16", "trainer.lora.targets=[linear_qkv]"])
    assert lora_engine_flags(cfg) == ["--enable-lora"]
    assert lora_gateway_flags(cfg) == ["--engine-lora-adapter", "policy"]
    sglang = load_config(
        config_file, ["trainer.lora.rank=16", "engines.backend=sglang", "engines.sglang.max_lora_rank=64"]
    )
    flags = lora_engine_flags(sglang)  # what engines.sglang sets is left to it
    assert flags[:1] == ["--sglang-enable-lora"] and "--sglang-max-lora-rank" not in flags
    assert flags[flags.index("--sglang-lora-target-modules") + 1 :] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"]  # fmt: skip


def test_an_r3_run_has_its_gateway_ask_the_routed_experts(config_file):
    from palaestra.orchestrator.cluster import routing_gateway_flags

    assert routing_gateway_flags(load_config(config_file, [])) == []
    assert routing_gateway_flags(load_config(config_file, ["trainer.routing_replay=r2"])) == []
    assert routing_gateway_flags(load_config(config_file, ["trainer.routing_replay=r3"])) == [
        "--return-routed-experts"
    ]
    both = load_config(config_file, ["trainer.routing_replay=r3", "gateway.return_routed_experts=true"])
    assert routing_gateway_flags(both) == [] and "--return-routed-experts" in both.gateway.serve_flags()


def test_an_r3_run_starts_its_engines_returning_routed_experts(config_file):
    from palaestra.orchestrator.cluster import routing_engine_flags

    assert routing_engine_flags(load_config(config_file, [])) == []
    assert routing_engine_flags(load_config(config_file, ["trainer.routing_replay=r2"])) == []
    r3 = load_config(config_file, ["trainer.routing_replay=r3"])
    assert routing_engine_flags(r3) == ["--enable-return-routed-experts"]
    sglang = load_config(config_file, ["trainer.routing_replay=r3", "engines.backend=sglang"])
    assert routing_engine_flags(sglang) == ["--sglang-enable-return-routed-experts"]
    given = load_config(
        config_file, ["trainer.routing_replay=r3", "engines.engine.enable_return_routed_experts=true"]
    )
    assert routing_engine_flags(given) == []  # set in engines.engine: passed on from there, once


def test_trainer_ranks_count_pipeline_stages(config_file):
    """dp_size replicas of TP × PP ranks (a PP = 2 run needs two ranks even at dp_size 1)."""
    from palaestra.orchestrator.placement import trainer_world_size

    assert trainer_world_size(load_config(config_file, [])) == 1
    pp = ["trainer.megatron.pipeline_model_parallel_size=2"]
    assert trainer_world_size(load_config(config_file, pp)) == 2
    assert trainer_world_size(load_config(config_file, [*pp, "trainer.dp_size=2"])) == 4
    ep = ["trainer.megatron.expert_model_parallel_size=2", "trainer.dp_size=2"]  # EP ranks are DP ranks
    assert trainer_world_size(load_config(config_file, ep)) == 2


def test_flat_placement_keys_of_earlier_configs_are_read_under_gateway_placement(tmp_path, caplog):
    """`gateway.placement: true` and `gateway.placement_<x>` (before placement was a section) are
    read as `gateway.placement.enabled` / `gateway.placement.<x>`, each with a warning naming it."""
    from palaestra.gateway.engine_side.placement import PlacementConfig

    path = tmp_path / "old.yaml"
    path.write_text("gateway:\n  placement: true\n  placement_epsilon: 0.5\n  placement_groups: apart\n")
    with caplog.at_level("WARNING", logger="palaestra.config"):
        from_file = load_config(path, []).gateway.placement
        overridden = load_config(None, ["gateway.placement=true", "gateway.placement_admit_fill=0.8"]).gateway
    assert from_file == PlacementConfig(enabled="on", epsilon=0.5, groups="apart")
    assert overridden.placement == PlacementConfig(enabled="on", admit_fill=0.8)
    assert load_config(None, ["gateway.placement=false"]).gateway.placement.enabled == "off"
    for old, new in [
        ("gateway.placement", "gateway.placement.enabled"),
        ("gateway.placement_epsilon", "gateway.placement.epsilon"),
        ("gateway.placement_groups", "gateway.placement.groups"),
        ("gateway.placement_admit_fill", "gateway.placement.admit_fill"),
    ]:
        assert f"config key {old} is now {new}" in caplog.text, old


@pytest.mark.parametrize(
    ("written", "enabled"),
    [(None, "auto"), ("auto", "auto"), ("on", "on"), ("off", "off"), ("true", "on"), ("false", "off")],
)
def test_placement_enabled_reaches_the_gateway_as_written(written, enabled):
    """`gateway.placement.enabled` (default auto; YAML's true / false are on / off) is what the run's
    `palaestra gateway serve` gets: off too, which as a bool flag would have been left out and read as
    the default there."""
    import argparse

    from palaestra.gateway import cli as gateway_cli

    overrides = [] if written is None else [f"gateway.placement.enabled={written}"]
    options = load_config(None, overrides).gateway
    assert options.placement.enabled == enabled
    parser = argparse.ArgumentParser()
    gateway_cli.register(parser.add_subparsers(dest="group", required=True))
    required = ["gateway", "serve", "--model", "m", "--engine-url", "http://127.0.0.1:1"]
    served = gateway_cli.config_from_args(parser.parse_args([*required, *options.serve_flags()]))
    assert served.placement.enabled == enabled


@pytest.mark.parametrize(
    ("flags", "enabled"),
    [
        ([], "auto"),
        (["--placement"], "on"),
        (["--placement-enabled"], "on"),  # the bare flag of its earlier bool form
        (["--no-placement"], "off"),
        (["--placement-enabled", "off"], "off"),
        (["--placement-enabled", "auto"], "auto"),
    ],
)
def test_the_gateway_command_spells_placement_on_off_and_auto(flags, enabled):
    import argparse

    from palaestra.gateway import cli as gateway_cli

    parser = argparse.ArgumentParser()
    gateway_cli.register(parser.add_subparsers(dest="group", required=True))
    required = ["gateway", "serve", "--model", "m", "--engine-url", "http://127.0.0.1:1"]
    assert gateway_cli.config_from_args(parser.parse_args([*required, *flags])).placement.enabled == enabled


@pytest.mark.parametrize(
    "value", ["maybe", "autoo", "1", "0.5", "null", "[on]", "{a: 1}", "''", "x" * 10_000]
)
def test_a_placement_enabled_other_than_auto_on_off_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"gateway.placement.enabled={value}"])
    (problem,) = err.value.problems
    assert problem.startswith("gateway.placement.enabled: expected 'auto' | 'on' | 'off'"), problem


@pytest.mark.parametrize("value", ["maybe", None, 1, 0, 2.5, [], "ON"])
def test_placement_config_refuses_an_enabled_other_than_auto_on_off_or_a_bool(value):
    from palaestra.gateway.engine_side.placement import PlacementConfig

    with pytest.raises(ValueError, match="placement enabled must be 'auto', 'on' or 'off'"):
        PlacementConfig(enabled=value)
    assert PlacementConfig(enabled=True).enabled == "on" and PlacementConfig(enabled=False).enabled == "off"


def test_gateway_options_are_declared_once_by_the_gateway(capsys):
    """The run's gateway section is the gateway's own GatewayOptions, which GatewayConfig extends,
    and `palaestra gateway serve` parses what serve_flags() writes back into the same options
    (same names, types and defaults: its flags are generated from the fields)."""
    import argparse

    from palaestra.gateway import cli as gateway_cli
    from palaestra.gateway.config import GatewayConfig
    from palaestra.gateway.engine_side.placement import PlacementConfig
    from palaestra.gateway.options import GatewayOptions as GatewaysOwn

    assert GatewayOptions is GatewaysOwn and issubclass(GatewayConfig, GatewayOptions)
    parser = argparse.ArgumentParser()
    gateway_cli.register(parser.add_subparsers(dest="group", required=True))
    required = ["gateway", "serve", "--model", "m", "--engine-url", "http://127.0.0.1:1"]

    def served(flags: list[str]) -> GatewayConfig:
        return gateway_cli.config_from_args(parser.parse_args([*required, *flags]))

    # Defaults: the command's equal the dataclass's, field by field (GatewayConfig's own ones too).
    assert served([]) == GatewayConfig(model="m", engine_url="http://127.0.0.1:1")
    assert served(GatewayOptions().serve_flags()) == served([])
    # Every tunable option set away from its default survives the trip through the command line.
    tuned = load_config(
        None,
        [
            "gateway.reasoning_policy=keep",
            "gateway.pause_mode=reject",
            "gateway.pause_wait_s=1.5",
            "gateway.default_max_tokens=64",
            "gateway.context_length=2048",
            "gateway.tool_parser=hermes",
            "gateway.reasoning_parser=qwen3",
            "gateway.engine_timeout_s=30",
            "gateway.engine_retries=0",
            "gateway.engine_max_connections=64",
            "gateway.journal_fsync=always",
            "gateway.journal_fsync_interval_ms=10",
            "gateway.max_open_sessions=8",
            "gateway.session_idle_timeout_s=60",
            "gateway.spool_max_bytes=1000000",
            "gateway.max_backlog_samples=100",
            "gateway.max_body_bytes=1048576",
            "gateway.stream_send_timeout_s=5",
            "gateway.event_loop=asyncio",
            "gateway.engine_http=aiohttp",
            "gateway.max_tokens_over_context=reject",
            "gateway.return_routed_experts=true",
            "gateway.placement.enabled=true",
            "gateway.placement.epsilon=0.5",
            "gateway.placement.move_epsilon=2.0",
            "gateway.placement.groups=apart",
            "gateway.placement.new_sessions=env_prefix",
            "gateway.placement.pools=true",
            "gateway.placement.long_context_tokens=4096",
            "gateway.placement.session_idle_s=30",
            "gateway.placement.quarantine_s=5",
            "gateway.placement.admit_fill=0.8",
            "gateway.placement.admit_wait_s=10",
            "gateway.routing_trace=runs/routing.jsonl",
            "gateway.shards=2",
        ],
    ).gateway
    config = served(tuned.serve_flags())
    for f in dataclasses.fields(GatewayOptions):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        assert getattr(tuned, f.name) != default, f.name
        if f.name == "shards":  # the run's topology: each `serve` is one shard, not a flag of it
            assert "--shards" not in tuned.serve_flags() and config.shards == 1
            continue
        assert getattr(config, f.name) == getattr(tuned, f.name), f.name
    for f in dataclasses.fields(PlacementConfig):  # every placement setting, reachable from a run config
        assert getattr(tuned.placement, f.name) != f.default, f.name
    # Each flag's help is its field's docstring (compared without whitespace: argparse rewraps it).
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "serve", "--help"])
    help_text = "".join(capsys.readouterr().out.split())
    for name, doc in field_docs(GatewayConfig).items():
        if name == "shards":  # not a flag of one shard (above)
            continue
        assert f"--{name.replace('_', '-')}" in help_text, name
        assert doc and "".join(doc.split()) in help_text, name


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("run.mdoe=async", "run.mdoe: unknown key (did you mean 'run.mode'?)"),
        ("trainer.advantage_estimater=grpo", "did you mean 'trainer.advantage_estimator'"),
        ("enignes.count=3", "did you mean 'engines'"),
        (
            "engines.engine.num_thread=2",
            "engines.engine.num_thread: unknown key (did you mean 'engines.engine.num_threads'?)",
        ),
        ("router.health_check_interval=1", "did you mean 'router.health_check_interval_secs'"),
    ],
)
def test_unknown_keys_name_the_path_and_close_matches(override, expected):
    assert expected in error_of(None, [override])


def test_unknown_keys_in_the_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent("""
        run: {steps: 3, chekpoint_every: 2}
        trainer: {opd_kl_cof: 0.5}
        """)
    )
    message = error_of(path, [])
    assert "run.chekpoint_every: unknown key (did you mean 'run.checkpoint_every'?)" in message
    assert "trainer.opd_kl_cof: unknown key (did you mean 'trainer.opd.kl_coef'" in message  # all reported


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("run.steps=abc", "run.steps: expected int, got 'abc'"),
        ("run.steps=2.5", "run.steps: expected int, got 2.5"),
        ("trainer.kl.coef=true", "trainer.kl.coef: expected float, got True"),
        (
            "run.mode=asynch",
            "run.mode: expected 'sync' | 'one_step_off' | 'async', got 'asynch' (str) (did you mean 'async'?)",
        ),
        ("env.args=[1, 2]", "env.args: expected dict[str, Any]"),
        ("model.teacher=[a]", "model.teacher: expected str | None"),
        ("engines=3", "engines: expected a mapping"),
        ("run.steps.x=1", "run.steps is int, not a section"),
        ("router.health_check_interval_secs=abc", "invalid int value: 'abc'"),
        ("run.steps", "expected key.path=value"),
    ],
)
def test_type_errors_name_the_path_and_expected_type(override, expected):
    assert expected in error_of(None, [override])


def test_bad_yaml_is_reported_with_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run: {steps: [1,\n")
    assert f"{path}: not valid YAML" in error_of(path, [])
    path.write_text("- a list\n")
    assert "expected a mapping of sections" in error_of(path, [])
    assert "cannot read" in error_of(tmp_path / "missing.yaml", [])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["run.mode=async", "run.max_staleness=0"], "run.max_staleness: mode 'async'"),
        (["run.mode=one_step_off", "run.max_staleness=0"], "need max_staleness >= 1"),
        (["env.samples_per_task=1"], "env.samples_per_task: 1, but trainer.advantage_estimator 'grpo'"),
        (
            [
                "env.filter_zero_variance_groups=true",
                "env.samples_per_task=1",
                "trainer.opd.kl_coef=0.1",
                "trainer.opd.teacher_mode=megatron",
                "model.teacher=tiny",
            ],
            "env.filter_zero_variance_groups",
        ),
        (
            ["trainer.opd.kl_coef=0.5", "trainer.opd.teacher_mode=sglang"],
            "teacher_urls",  # TrainerConfig's own check
        ),
        (
            ["trainer.opd.kl_coef=0.5", "trainer.opd.teacher_mode=megatron"],
            "model.teacher: trainer.opd.kl_coef > 0",
        ),
        (["model.teacher=tiny", "trainer.opd.teacher_model=other"], "disagrees with model.teacher"),
        (
            ["engines.backend=sglang", "trainer.sync.mode=tensor"],
            "trainer.sync.mode: SGLang's /update_weights",
        ),
        (["run.resources={gpu_box: {x: 1}}"], "run.resources: keys must be trainer, engines, services"),
        (["run.resources={trainer: {node_a: -1}}"], "run.resources: every demand must be a number >= 0"),
        (["trainer.dp_size=0"], "trainer.dp_size: must be at least 1"),  # under the field's own path
        (["trainer.advantage_eps=0"], "trainer.advantage_eps: must be positive"),  # was a ZeroDivisionError
        (["trainer.sync.mode=disk"], "trainer.sync.dir: sync.mode 'disk' needs a directory"),
        (["engines.count=0"], "engines.count: need at least 1"),
        (["run.name=a/b"], "run.name"),
        (["engines.engine.port=1"], "engines.engine.port: not accepted"),
        (["engines.sglang.model_path=x"], "engines.sglang.model_path: not accepted"),
        (["router.policy=round_robin"], "router.policy: not accepted"),
        (
            ["trainer.lora.rank=16", "engines.engine.enable_lora=false"],
            "engines.engine.enable_lora: false, but trainer.lora.rank 16",
        ),
        (
            ["trainer.lora.rank=16", "engines.backend=sglang", "engines.sglang.max_lora_rank=8"],
            "engines.sglang.max_lora_rank 8 is below trainer.lora.rank 16",
        ),
    ],
)
def test_cross_field_validation(overrides, expected):
    assert expected in error_of(None, overrides)


def test_pure_opd_allows_one_sample_per_task_and_an_external_teacher():
    cfg = load_config(
        None,
        [
            "env.samples_per_task=1",
            "trainer.opd.kl_coef=1.0",
            "trainer.opd.teacher_mode=sglang",
            "trainer.opd.teacher_urls=[http://127.0.0.1:9]",
        ],
    )
    assert cfg.model.teacher is None and cfg.env.samples_per_task == 1


class TaggedEnv(Environment):
    """Takes string arguments that YAML would read as a number and a bool if unquoted."""

    def __init__(self, difficulty: int = 1, tag: str = "", on: str = ""):
        self.difficulty, self.tag, self.on = difficulty, tag, on

    def tasks(self, seed):
        return [Task("t")]

    async def rollout(self, session, task):
        return 0.0


def test_round_trip(config_file, tmp_path):
    cfg = load_config(
        config_file,
        [
            "run.mode=one_step_off",
            "trainer.megatron_optimizer.lr=3e-6",
            "env.name=tests.palaestra.test_config:TaggedEnv",
            "env.args.tag='1e5'",
            "env.args.on='yes'",
        ],
    )
    assert cfg.env.args == {
        "difficulty": 1,
        "tag": "1e5",
        "on": "yes",
    }  # strings that look like numbers/bools
    saved = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert saved.read_text().startswith("# palaestra run config")
    again = load_config(saved, [])
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert config_to_dict(cfg)["trainer"]["megatron_optimizer"]["lr"] == 3e-6


def _field_paths(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_help_mentions_every_field_with_type_default_and_doc():
    text = config_help()
    paths = list(_field_paths(RunConfig))
    assert len(paths) > 60
    for path in paths:
        assert f"{path}: " in text, path
    assert "run.max_staleness: int = 1\n" in text
    assert "run.mode: 'sync' | 'one_step_off' | 'async' = sync\n" in text
    assert "logging.wandb_project: str | None = null\n" in text
    # Field docstrings are read from the source with ast (Python drops them), TrainerConfig's too.
    opd_docs = field_docs(OpdOptions)
    assert opd_docs["kl_coef"] and opd_docs["kl_coef"].splitlines()[0] in text
    assert "trainer.opd.kl_coef: float = 0.0\n" in text and "trainer.sync.mode: " in text
    for cls in (
        TrainerConfig,
        *TRAINER_SECTIONS.values(),
        RunConfig,
        ModelOptions,
        EngineOptions,
        GatewayOptions,
        EnvOptions,
        RunOptions,
        LoggingOptions,
    ):
        for name, doc in field_docs(cls).items():
            assert doc, f"{cls.__name__}.{name} has no docstring"
            assert doc.splitlines()[0] in text


@pytest.mark.parametrize("name", ["demo.yaml", "gpu-sglang.yaml", "moe.yaml"])
def test_shipped_configs_load(name):
    """The configs in configs/ stay valid as the schema moves (the README points at them)."""
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / name)
    assert cfg.run.steps > 0 and cfg.env.tasks_per_step > 0
    if name == "demo.yaml":  # what make demo promises: GRPO + OPD from the warm-started teacher
        assert (cfg.model.student, cfg.model.teacher) == ("demo-student", "demo-teacher")
        assert cfg.trainer.opd.kl_coef > 0 and cfg.trainer.advantage_estimator == "grpo"
        assert cfg.engines.count >= 2 and cfg.env.args["difficulty"] == 0
    if name == "moe.yaml":  # the documented commands: EP = 2 over its 2 ranks, or PP = 2 on one
        assert cfg.trainer.routing_replay == "r3" and cfg.trainer.dp_size == 2
        ep = load_config(root / "configs" / name, ["trainer.megatron.expert_model_parallel_size=2"])
        assert ep.trainer.megatron["expert_model_parallel_size"] == 2
        off = load_config(
            root / "configs" / name, ["trainer.routing_replay=off"]
        )  # YAML reads `off` as false
        assert off.trainer.routing_replay == "off"


def test_demo_picks_a_fresh_run_name(tmp_path, monkeypatch):
    from palaestra.demo import _fresh_name

    monkeypatch.chdir(tmp_path)
    assert _fresh_name("demo") == "demo"
    (tmp_path / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "demo-2" / "checkpoints").mkdir(parents=True)
    assert _fresh_name("demo") == "demo-3"


def test_keep_old_actor_follows_the_mode():
    """Only in one_step_off did the previous step's weights sample the batch: the default follows
    run.mode, and setting it in another mode is refused with the reason."""
    assert load_config(None, ["run.mode=one_step_off"]).trainer.keep_old_actor is True
    assert load_config(None, ["run.mode=sync"]).trainer.keep_old_actor is False
    assert load_config(None, ["run.mode=async"]).trainer.keep_old_actor is False
    assert (
        load_config(None, ["run.mode=one_step_off", "trainer.keep_old_actor=false"]).trainer.keep_old_actor
        is False
    )
    with pytest.raises(ConfigError, match="the current weights sampled it"):
        load_config(None, ["run.mode=sync", "trainer.keep_old_actor=true"])
    with pytest.raises(ConfigError, match="use trainer.tis.enabled"):
        load_config(None, ["run.mode=async", "trainer.keep_old_actor=true"])


# ----------------------------------------------------------------------------------------------
# env.args against the environment's constructor; the teacher's one switch
# ----------------------------------------------------------------------------------------------
class NeedsData(Environment):
    def __init__(self, data: str, max_turns: int = 4):
        self.data, self.max_turns = data, max_turns

    def tasks(self, seed):
        return [Task("t")]

    async def rollout(self, session, task):
        return 0.0


class TakesAnything(NeedsData):
    def __init__(self, **options):  # stores them: no base constructor sees them
        self.options = options


def test_another_environment_on_a_file_names_the_file_s_arguments_and_how_to_drop_them():
    """configs/demo.yaml's math arguments stay when env.name is overridden: the error says which
    keys came from the file, and env.args=null drops them (env.args={...} replaces them)."""
    message = error_of(DEMO, ["env.name=code"])
    assert "env.args.kinds: not an argument of environment 'code' " in message
    assert (
        "(palaestra.environments.code_sandbox.env:CodeSandboxEnv, which takes source, difficulty" in message
    )
    assert f"(set in {DEMO})" in message
    assert (
        f"env.args: kinds came from {DEMO}, whose env.name is 'math'; an override of env.name keeps the "
        "file's env.args: drop them with the override env.args=null" in message
    )
    assert "env.args.difficulty" not in message and "env.args.max_tokens" not in message  # code takes both
    assert load_config(DEMO, ["env.name=code", "env.args=null"]).env.args == {}
    assert load_config(DEMO, ["env.name=code", "env.args={}"]).env.args == {}
    assert load_config(DEMO, ["env.name=code", "env.args={difficulty: 1}"]).env.args == {"difficulty": 1}
    assert load_config(DEMO, ["env.name=math-tool", "env.args.max_turns=2"]).env.args["max_turns"] == 2


def test_environment_arguments_are_checked_at_load(tmp_path):
    message = error_of(None, ["env.args.difficultyy=2"])
    assert message.endswith(
        "env.args.difficultyy: not an argument of environment 'math' (palaestra.environments.math.env:"
        "MathEnv, which takes difficulty, data, max_tokens, kinds) (did you mean 'difficulty'?) "
        "(set in an override)"
    )
    assert "came from" not in message  # nothing from a file
    path = tmp_path / "run.yaml"
    path.write_text("env: {name: math, args: {levels: 3}}\n")
    message = error_of(path, [])
    assert (
        "env.args.levels: not an argument of environment 'math'" in message and f"(set in {path})" in message
    )
    assert "came from" not in message  # the file's own environment: nothing was overridden
    # MathToolEnv(max_turns, **kwargs): where **kwargs go is not in a signature, so the signature
    # passes any key; the environment is then built with them at load, so a value it refuses (the
    # word problems have no difficulty 0) is reported now, with its own message
    assert load_config(None, ["env.name=math-tool", "env.args={max_turns: 2, difficulty: 2}"]).env.args
    message = error_of(None, ["env.name=math-tool", "env.args={max_turns: 2, difficulty: 0}"])
    assert "env.args: environment 'math-tool'" in message and "could not be built with" in message
    assert "difficulty must be 1..5 for word_problem tasks" in message
    assert load_config(None, ["env.name=tests.palaestra.test_config:TakesAnything", "env.args.whatever=1"])
    message = error_of(
        None, ["env.name=tests.palaestra.test_config:NeedsData", "env.args={data: x, turns: 2}"]
    )
    assert (
        "env.args.turns: not an argument of environment 'tests.palaestra.test_config:NeedsData' " in message
    )
    # A required argument; **kwargs that go nowhere accept anything; the sampling temperature is
    # the run's (taken out of env.args), never the constructor's
    message = error_of(None, ["env.name=tests.palaestra.test_config:NeedsData"])
    assert (
        "env.args.data: environment 'tests.palaestra.test_config:NeedsData' (tests.palaestra.test_config:NeedsData, which takes "
        in message
    )
    assert "data, max_turns) needs it (no default); set env.args.data=..." in message
    assert load_config(
        None, ["env.name=tests.palaestra.test_config:NeedsData", "env.args={data: x, temperature: 1.0}"]
    )
    # The environment itself: a name not in the registry, a module that is not there
    assert (
        "env.name: unknown environment 'maths': use one of math, math-tool, code, swe, reasoning-gym"
        in error_of(None, ["env.name=maths"])
    )
    message = error_of(None, ["env.name=nowhere_module:Env"])
    assert "env.name: environment 'nowhere_module:Env': no module named 'nowhere_module'" in message


def test_model_teacher_null_is_the_one_switch_that_turns_the_teacher_off(caplog):
    """configs/demo.yaml distils from its teacher (opd_kl_coef 1.0, teacher_mode megatron): one
    override takes it out, said in one line; the run then trains with GRPO alone."""
    with caplog.at_level("INFO", logger="palaestra.config"):
        cfg = load_config(DEMO, ["model.teacher=null"])
    assert cfg.model.teacher is None and cfg.trainer.opd.teacher_model is None
    assert cfg.trainer.opd.kl_coef == 0.0 and cfg.trainer.opd.teacher_mode is None
    assert not cfg.trainer.opd.enabled and cfg.trainer.advantage_estimator == "grpo"
    lines = [r.getMessage() for r in caplog.records if r.name == "palaestra.config"]
    assert lines == [
        "model.teacher=null: no teacher, on-policy distillation off (trainer.opd.kl_coef 1.0 -> 0, "
        "trainer.opd.teacher_mode megatron -> null)"
    ]
    # The resolved config loads back as it is, saying nothing (the switch is already applied).
    caplog.clear()
    with caplog.at_level("INFO", logger="palaestra.config"):
        again = load_config(
            DEMO, ["model.teacher=null", "trainer.opd.kl_coef=0", "trainer.opd.teacher_mode=null"]
        )
    assert again == cfg and not [r for r in caplog.records if r.name == "palaestra.config"]
    # Another teacher stays: an sglang one, or a trainer.opd.teacher_model of its own
    kept = load_config(
        DEMO,
        [
            "model.teacher=null",
            "trainer.opd.teacher_mode=sglang",
            "trainer.opd.teacher_urls=[http://127.0.0.1:9]",
        ],
    )
    assert kept.trainer.opd.kl_coef == 1.0 and kept.trainer.opd.teacher_mode == "sglang"
    kept = load_config(DEMO, ["model.teacher=null", "trainer.opd.teacher_model=/models/teacher"])
    assert kept.trainer.opd.kl_coef == 1.0 and kept.trainer.opd.teacher_model == "/models/teacher"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (  # OPD, megatron mode, no teacher: how to add one, and how to go without
            ["trainer.opd.kl_coef=0.5", "trainer.opd.teacher_mode=megatron"],
            "set model.teacher to a preset or HF directory, or train without one: model.teacher=null",
        ),
        (
            ["trainer.opd.teacher_mode=megatron"],
            "model.teacher: trainer.opd.teacher_mode megatron needs a teacher",
        ),
        (["trainer.opd.kl_coef=0.5"], "or opd.kl_coef: 0 for no distillation"),
        (["trainer.opd.teacher_mode=sglang"], "needs teacher_urls; or teacher_mode: null for no teacher"),
    ],
)
def test_teacher_errors_say_how_to_turn_it_off_too(overrides, expected):
    assert expected in error_of(None, overrides)


# ----------------------------------------------------------------------------------------------
# The trainer's flat keys of the previous release: still read, with a warning naming the new key
# ----------------------------------------------------------------------------------------------
FLAT_TRAINER = """\
model: {student: tiny, teacher: tiny}
trainer:
  opd_kl_coef: 0.5
  teacher_mode: megatron
  opd_granularity: topk
  use_tis: true
  rs_mode: token
  kl_coef: 0.1
  sync_mode: disk
  sync_dir: /shared/sync
  snapshot_prefetch: false
"""


def _deprecations(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FutureWarning)]


def test_renamed_trainer_keys_name_fields_of_their_sections():
    for old, new in RENAMED.items():
        section, name = new.split(".")
        assert not hasattr(TrainerConfig(), old), old
        assert name in {f.name for f in dataclasses.fields(TRAINER_SECTIONS[section])}, new
    assert len(dataclasses.fields(TrainerConfig)) == 25  # 48 before sections; + moe, dynamic_sampling


def test_flat_trainer_keys_in_a_yaml_file_still_load_and_warn_naming_the_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(FLAT_TRAINER)
    with pytest.warns(FutureWarning) as record:
        cfg = load_config(path, [])
    tr = cfg.trainer
    assert (tr.opd.kl_coef, tr.opd.teacher_mode, tr.opd.granularity) == (0.5, "megatron", "topk")
    assert tr.opd.teacher_model == "tiny"  # model.teacher's default reaches the moved section
    assert tr.tis.enabled and tr.rs.mode == "token" and tr.kl.coef == 0.1
    assert (tr.sync.mode, tr.sync.dir, tr.snapshot.prefetch) == ("disk", "/shared/sync", False)
    messages = _deprecations(record)
    assert "trainer.sync_mode is deprecated: use trainer.sync.mode" in messages
    assert "trainer.use_tis is deprecated: use trainer.tis.enabled" in messages
    assert "trainer.opd_kl_coef is deprecated: use trainer.opd.kl_coef" in messages
    # The same run in the new keys is the same config, and is what a run saves
    new = load_config(
        None,
        [
            "model.teacher=tiny",
            "trainer.opd={kl_coef: 0.5, teacher_mode: megatron, granularity: topk}",
            "trainer.tis.enabled=true",
            "trainer.rs.mode=token",
            "trainer.kl.coef=0.1",
            "trainer.sync={mode: disk, dir: /shared/sync}",
            "trainer.snapshot.prefetch=false",
        ],
    )
    assert new == cfg
    saved = save_config(cfg, tmp_path / "saved.yaml").read_text()
    assert "sync_mode" not in saved and "opd_kl_coef" not in saved and "  sync:\n" in saved


def test_flat_trainer_keys_in_overrides_still_apply_and_warn_naming_the_new_key():
    with pytest.warns(FutureWarning) as record:
        cfg = load_config(None, ["trainer.sync_mode=disk", "trainer.sync_dir=/x", "trainer.rs_low=0.25"])
    assert (cfg.trainer.sync.mode, cfg.trainer.sync.dir, cfg.trainer.rs.low) == ("disk", "/x", 0.25)
    messages = _deprecations(record)
    assert "trainer.sync_dir is deprecated: use trainer.sync.dir" in messages
    assert "trainer.rs_low is deprecated: use trainer.rs.low" in messages
    # An old key overrides the file's new one, like any override (it names the same option)
    with pytest.warns(FutureWarning, match="trainer.kl_mode is deprecated: use trainer.kl.mode"):
        assert load_config(DEMO, ["trainer.kl_mode=reward"]).trainer.kl.mode == "reward"
    # Checks of a moved key name its new path
    with pytest.warns(FutureWarning):
        message = error_of(None, ["trainer.sync_group_port=70000"])
    assert "trainer.sync.group_port: must be between 0 and 65535; got 70000" in message
    with pytest.warns(FutureWarning):
        message = error_of(None, ["trainer.sync_mode=nccl"])
    assert "trainer.sync.mode: expected 'shm' | 'distributed'" in message


def test_a_key_set_under_its_old_and_its_new_name_is_an_error(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("trainer:\n  sync_mode: shm\n  sync: {mode: disk, dir: /x}\n")
    message = error_of(path, [])
    assert (
        "trainer.sync_mode: set as well as its new name trainer.sync.mode; keep only trainer.sync.mode"
        in message
    )
    with pytest.warns(FutureWarning, match="trainer.use_tis is deprecated"):
        message = error_of(None, ["trainer.tis.enabled=true", "trainer.use_tis=false"])
    assert "both set trainer.tis.enabled; keep only trainer.tis.enabled=..." in message
    with pytest.raises(ValueError, match="trainer.kl_coef: set as well as its new name trainer.kl.coef"):
        TrainerConfig.from_dict({"kl_coef": 0.1, "kl": {"coef": 0.2}})


def test_a_saved_flat_trainer_config_still_loads(recwarn):
    """A checkpoint of the previous release stores TrainerConfig.to_dict() with flat keys."""
    flat = {"seed": 7, "sync_mode": "disk", "sync_dir": "/x", "use_tis": True, "snapshot_prefetch": False}
    config = TrainerConfig.from_dict(flat)
    assert config == TrainerConfig(
        seed=7, sync=SyncOptions(mode="disk", dir="/x"), tis=TisOptions(enabled=True),
        snapshot=SnapshotOptions(prefetch=False),
    )  # fmt: skip
    assert "trainer.snapshot_prefetch is deprecated: use trainer.snapshot.prefetch" in _deprecations(recwarn)
    assert TrainerConfig.from_dict(config.to_dict()) == config and "sync_mode" not in config.to_dict()
