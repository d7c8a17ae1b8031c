"""The `palaestra` command line.

Each command group lives next to the code it drives and registers its sub-commands here:
`palaestra engine serve` (engine/cli.py), `palaestra router serve` (engine/router.py),
`palaestra sglang launch` (engine/sglang_launcher.py), `palaestra model build` (palaestra/presets.py),
`palaestra train` (palaestra/train.py).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from palaestra import presets
    from palaestra import train as train_cmd
    from palaestra.engine import cli as engine_cli
    from palaestra.engine import router, sglang_launcher
    from palaestra.gateway import cli as gateway_cli
    from palaestra.sandbox import cli as sandbox_cli
    from palaestra.sdk import cli as sdk_cli

    parser = argparse.ArgumentParser(
        prog="palaestra",
        description="Palaestra: an environment-centric agentic RL gym.",
    )
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    engine_cli.register(groups)
    router.register(groups)
    sglang_launcher.register(groups)
    presets.register(groups)
    gateway_cli.register(groups)
    sdk_cli.register(groups)
    sandbox_cli.register(groups)
    train_cmd.register(groups)
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
