"""The `palaestra` command line.

Each command group lives next to the code it drives and registers its sub-commands here:

    palaestra engine serve                       engine/cli.py (the embedded CPU engine)
    palaestra router serve                       engine/router.py (sglang-router)
    palaestra sglang launch                      engine/sglang_launcher.py (a real SGLang server)
    palaestra model build                        palaestra/models/cli.py (model presets)
    palaestra gateway serve | front              gateway/cli.py (front: gateway/shards.py)
    palaestra rollout | eval | session new|reward|show | envs  sdk/cli.py (environments through a gateway)
    palaestra sandbox exec|serve|build-images    sandbox/cli.py
    palaestra train                              palaestra/train.py (a run on Ray)
    palaestra export                             trainer/export.py (PEFT adapter, merged HF model)
    palaestra swe generate|validate|fetch        environments/swe_agent/cli.py
    palaestra harness install|path               environments/harness/install.py (Claude Code, Codex)
    palaestra harbor validate                    environments/harbor/cli.py (Harbor task directories)

`palaestra --help` lists them (tests/palaestra/test_docs_true.py checks this list against it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each top-level command and the module whose `register(groups)` adds it. `palaestra <command> ...`
# imports only that module, so a server subprocess (`palaestra gateway serve`, `palaestra engine
# serve`) does not pay for torch, openai and Ray that other commands need; `palaestra --help` and
# anything unknown build the whole parser. tests/palaestra/test_docs_true.py checks this table against
# what the modules register.
COMMANDS: dict[str, str] = {
    "engine": "palaestra.engine.cli",
    "router": "palaestra.engine.router",
    "sglang": "palaestra.engine.sglang_launcher",
    "model": "palaestra.models.cli",
    "gateway": "palaestra.gateway.cli",
    "rollout": "palaestra.sdk.cli",
    "eval": "palaestra.sdk.cli",
    "session": "palaestra.sdk.cli",
    "envs": "palaestra.sdk.cli",
    "sandbox": "palaestra.sandbox.cli",
    "train": "palaestra.train",
    "export": "palaestra.trainer.export",
    "swe": "palaestra.environments.swe_agent.cli",
    "harness": "palaestra.environments.harness.install",
    "harbor": "palaestra.environments.harbor.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of `command` (one of COMMANDS) and its siblings in
    the same module."""
    parser = argparse.ArgumentParser(
        prog="palaestra",
        description="Palaestra: an environment-centric agentic RL gym.",
    )
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    modules = [COMMANDS[command]] if command is not None else list(dict.fromkeys(COMMANDS.values()))
    for module in modules:
        importlib.import_module(module).register(groups)
    return parser


def error_line(command: str, exc: BaseException) -> str:
    """What a command prints when it fails: ``palaestra <command>: <Error>: <message>`` on one line
    (a multi-line message joined with "; "), as `train` prints a config error, so the user reads
    what to change and not a traceback; PALAESTRA_TRACEBACK=1 shows the traceback instead."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = "; ".join(lines) or repr(exc)
    prefix = "" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: "
    return f"palaestra {command}: {prefix}{message}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("PALAESTRA_TRACEBACK"):
            raise
        argv = sys.argv[1:] if argv is None else list(argv)
        print(error_line(" ".join(argv[:1]) or "", exc), file=sys.stderr)
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    accepts_extra = getattr(args, "accepts_extra", False)
    if extra and not accepts_extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "model_dir") and args.model_dir is None:
        # A command that loads a model (`model_dir` among its defaults: `engine serve`) gets the
        # directory of its --model here, a preset built on first use: the engine below does not
        # import the preset table.
        from palaestra.models import resolve_model

        args.model_dir = str(resolve_model(args.model))
    if accepts_extra:
        return int(args.func(args, extra) or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
