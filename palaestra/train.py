"""`palaestra train CONFIG.yaml [section.field=value ...]`: one RL/OPD run, end to end, on Ray.

    palaestra train configs/demo.yaml
    palaestra train configs/demo.yaml run.mode=async run.max_staleness=2 run.steps=50
    palaestra train configs/demo.yaml run.resume=true          # from the latest checkpoint
    palaestra train configs/demo.yaml --resume                 # the same (e.g. after the driver was killed)
    palaestra train configs/demo.yaml --supervise 3            # relaunched with --resume after a crash, 3x

The loop, per step (`run.mode` decides what overlaps):

    batch   = the step's groups of samples, read from the gateway's /samples cursor
              sync:          generate step k, then train on it
              one_step_off:  generate step k+1 while training on step k (samples 1 version old)
              async:         generate continuously; samples older than run.max_staleness
                             versions are dropped or masked (counted)
    metrics = trainer.step(batch, sync=False)   one optimizer step (Megatron)
    sync    = the new weights to every engine   (async: the gateway is paused around it, so
                                                 sessions in flight keep their tokens and go on
                                                 with the new version); the version is the trainer's
    log, checkpoint every run.checkpoint_every steps

Before the first and after the last step the student is evaluated greedily on `env.eval_tasks`
held-out tasks; the run ends with `reward_curve.png`, `viewer.html` and one summary line in the
output directory. The trainer is `trainer.dp_size` × tensor-parallel rank actors placed by Ray
(one process group; each batch split over the data-parallel replicas, gradients all-reduced;
tests/orchestrator/test_multinode.py runs two ranks on two Ray nodes). Simplifications, on purpose: in sync and
one-step-off modes a step whose groups are all filtered makes no update (async mode fills its
batch instead). A process that dies mid-run (an engine, the router, the gateway, the environment
runner, a trainer rank) is restarted or replaced and the run goes on (orchestrator/supervisor.py,
docs/reliability-faults.md), up to run.max_restarts times each.

The config is checked whole before anything starts (`palaestra.config.load_config`): every
option's type and range, `env.args` against the environment's constructor, the teacher
(`model.teacher=null` trains without one).

`train` below is the whole algorithm; the mechanics live in `palaestra.orchestrator` (the cluster
and its actors, batch selection, the modes, metrics, checkpoints, the report). See docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from palaestra.config import ConfigError, RunConfig, config_help, config_to_dict, load_config
from palaestra.orchestrator.checkpoint import prepare_run
from palaestra.orchestrator.cluster import start_cluster
from palaestra.orchestrator.errors import Replaced, RunFailed
from palaestra.orchestrator.loop import PHASES, Hook, Run, RunResult, eval_row

__all__ = ["register", "train"]


def train(cfg: RunConfig, *, hook: Hook | None = None) -> RunResult:
    """Runs `cfg` to the end; raises RunFailed (with the failing box and its log) if it cannot.

    `hook(phase, step, run)`, if given, is called at named phases of every step (`loop.PHASES`:
    the batch read, before and after a checkpoint, the step's end); tests kill processes there.
    """
    state, checkpoint = prepare_run(cfg)  # fresh, or the latest checkpoint's state
    with (
        start_cluster(cfg, weight_version=state.weight_version, output_dir=cfg.output_dir) as cluster,
        Run(cfg, cluster, state, fresh=checkpoint is None, hook=hook) as run,
    ):
        if checkpoint is not None:
            run.restore(checkpoint)  # the trainer's weights, optimizer, RNG; then onto the engines
        elif cfg.env.eval_tasks:
            run.evaluate_before()
        with run.stepping():  # the mode's generation runs from here on
            while run.state.step < cfg.run.steps:
                step = run.state.step  # a fault's recovery may roll it back to a checkpoint
                try:
                    batch = run.next_batch(step)  # the step's groups: staleness-bounded, filtered
                    metrics = run.train(step, batch)  # one optimizer step; engines keep the old weights
                    metrics |= run.sync(step, batch)  # new weights on every engine, the trainer's version
                    metrics |= run.end_step(step, batch)  # tasks consumed, spool cursor, step timing
                    if run.evaluation_due(step):
                        metrics |= eval_row(run.evaluate(f"step{step + 1}"))
                    run.log(step, metrics)  # metrics.jsonl, TensorBoard/W&B, the console line
                    if run.checkpoint_due(step):
                        run.checkpoint()
                except Replaced as fault:  # the runner or the trainer died: redo from the run's state
                    run.recover(fault)
                    continue
                run.at("step", step)  # the step is over (a test's hook may kill a process here)
        try:
            if cfg.env.eval_tasks:
                run.evaluate_after()
            result = run.result()  # the engines' versions, read before any teacher weights go on
            if result.eval_after is not None and cfg.env.eval_teacher and cfg.model.teacher:
                result.teacher_accuracy = run.evaluate_teacher()
            return run.report(result)  # reward_curve.png, viewer.html, the summary line
        except Replaced as fault:  # every step is trained and checkpointed: nothing to redo
            raise RunFailed(f"{fault} after the last step; the run's last checkpoint is complete") from None


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------
SUPERVISED = "PALAESTRA_SUPERVISED"
"""Set in the driver that `--supervise` launches, so that it runs the training itself."""


def supervise(argv: list[str], times: int, launch=None) -> int:
    """`palaestra train ... --supervise N`: runs the driver (`argv`, this command's arguments without
    --supervise) as a child process and, each time it ends abnormally (killed by a signal, or a
    failed run: exit 1), launches it again with --resume, at most `times` times; a config error
    (exit 2) or success ends it at once. Returns the last launch's exit code. `launch(cmd)` runs
    one launch (default: `subprocess.call` with `SUPERVISED` set)."""
    import subprocess

    if launch is None:
        env = {**os.environ, SUPERVISED: "1"}
        launch = lambda cmd: subprocess.call(cmd, env=env)  # noqa: E731
    cmd = [sys.executable, "-m", "palaestra.cli", "train", *argv]
    code = launch(cmd)
    for attempt in range(1, times + 1):
        if code in (0, 2):
            return code
        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        print(f"palaestra train --supervise: the driver ended ({why}); launch {attempt + 1} of at most "
              f"{times + 1}, with --resume", file=sys.stderr, flush=True)  # fmt: skip
        code = launch([*cmd, *([] if "--resume" in cmd else ["--resume"])])
    return code


def _command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("megatron").setLevel(logging.WARNING)  # parameter lists when a model is built
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # only overrides, no file
    if args.resume:
        overrides.append("run.resume=true")
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.supervise and not os.environ.get(SUPERVISED):  # the same command, less --supervise
        argv = [*([args.config] if args.config else []), *args.overrides]
        return supervise([*argv, *(["--resume"] if args.resume else [])], args.supervise)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    try:
        train(cfg, hook=_halt_hook(os.environ.get(HALT_ENV), cfg.output_dir))
    except RunFailed as exc:
        print(f"palaestra train: {exc}", file=sys.stderr)
        return 1
    return 0


HALT_ENV = "PALAESTRA_TEST_HALT_AT"
"""TEST HOOK, read only by `palaestra train`: ``<phase>:<step>`` (one of `loop.PHASES`, the step
0-based) makes the driver stop there: it writes ``halted`` into the run's directory and waits, so
that a test can kill its process group at that moment (tests/orchestrator/test_driver_kill.py)."""


def _halt_hook(value: str | None, output_dir: Path) -> Hook | None:
    """The test hook of `HALT_ENV`, or None when the variable is unset."""
    if not value:
        return None
    phase, _, step = value.partition(":")
    if phase not in PHASES or not step.isdigit():
        raise SystemExit(f"{HALT_ENV}={value!r}: expected <phase>:<step> with a phase of {', '.join(PHASES)}")

    def halt(at: str, at_step: int, run: Run) -> None:
        if (at, at_step) == (phase, int(step)):
            (output_dir / "halted").write_text(f"{value} {os.getpid()}\n")
            while True:  # until the test's SIGKILL
                time.sleep(3600)

    return halt


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 of relaunches, got {text!r}")
    return value


def register(groups) -> None:
    p = groups.add_parser(
        "train",
        help="train a policy end to end on Ray (engines, router, gateway, environment, trainer)",
        description="Run RL/OPD training: YAML config plus dotted overrides (section.field=value), "
        "checked whole before anything starts (env.args against the environment's constructor; "
        "model.teacher=null trains without a teacher). Modes: sync, one_step_off, async (run.mode). "
        "Writes runs/<name>/: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, logs/, spool/ "
        "(the gateway's samples), reward_curve.png, viewer.html. See docs/training.md.",
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config (omit to use only defaults)")
    p.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides, e.g. run.steps=10 run.mode=async"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.output_dir from its latest checkpoint (= run.resume=true), e.g. "
        "after its driver was killed",
    )
    p.add_argument(
        "--supervise",
        type=_non_negative,
        default=0,
        metavar="N",
        help="run the driver as a child and relaunch it with --resume after it crashes (killed, or "
        "exit 1), at most N times (default: %(default)s, no relaunch)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=_command)
