"""The `palaestra` command line.

Each command group lives next to the code it drives and registers its sub-commands here:

    palaestra engine serve                       engine/cli.py (the embedded CPU engine)
    palaestra router serve                       engine/router.py (sglang-router)
    palaestra sglang launch                      engine/sglang_launcher.py (a real SGLang server)
    palaestra model build                        palaestra/models/cli.py (model presets)
    palaestra gateway serve                      gateway/cli.py
    palaestra rollout | eval | session new|reward  sdk/cli.py (environments through a gateway)
    palaestra sandbox exec|serve|build-images    sandbox/cli.py
    palaestra train                              palaestra/train.py (a run on Ray)
    palaestra export                             trainer/export.py (PEFT adapter, merged HF model)
    palaestra swe generate|validate              environments/swe_agent/cli.py
    palaestra harness install|path               environments/harness/install.py (Claude Code, Codex)

`palaestra --help` lists them (tests/palaestra/test_docs_true.py checks this list against it).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from palaestra import train as train_cmd
    from palaestra.engine import cli as engine_cli
    from palaestra.engine import router, sglang_launcher
    from palaestra.environments.harness import install as harness_cli
    from palaestra.environments.swe_agent import cli as swe_cli
    from palaestra.gateway import cli as gateway_cli
    from palaestra.models import cli as models_cli
    from palaestra.sandbox import cli as sandbox_cli
    from palaestra.sdk import cli as sdk_cli
    from palaestra.trainer import export as export_cmd

    parser = argparse.ArgumentParser(
        prog="palaestra",
        description="Palaestra: an environment-centric agentic RL gym.",
    )
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    engine_cli.register(groups)
    router.register(groups)
    sglang_launcher.register(groups)
    models_cli.register(groups)
    gateway_cli.register(groups)
    sdk_cli.register(groups)
    sandbox_cli.register(groups)
    train_cmd.register(groups)
    export_cmd.register(groups)
    swe_cli.register(groups)
    harness_cli.register(groups)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    accepts_extra = getattr(args, "accepts_extra", False)
    if extra and not accepts_extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if accepts_extra:
        return int(args.func(args, extra) or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
