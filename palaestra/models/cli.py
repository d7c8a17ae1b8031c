"""`palaestra model build NAME [--cache-dir DIR]`: build a preset once and print its directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from palaestra.models.registry import PRESETS, resolve_model

__all__ = ["register"]


def register(groups: argparse._SubParsersAction) -> None:
    """Add ``palaestra model build NAME [--cache-dir DIR]`` to the top-level sub-commands."""
    preset_lines = "\n".join(f"  {name:<14} {preset.description}" for name, preset in PRESETS.items())
    model = groups.add_parser(
        "model",
        help="build model presets",
        description="Build the model presets Palaestra can run without downloading anything.",
    )
    commands = model.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    build = commands.add_parser(
        "build",
        help="build a preset (once) and print its model directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Build a model preset into the cache, unless it is already there, and print the\n"
            "Hugging Face model directory (config.json, safetensors, tokenizer) on stdout.\n"
            "Concurrent builds of the same preset are safe: one builds, the others wait."
        ),
        epilog=f"presets:\n{preset_lines}",
    )
    build.add_argument("name", metavar="NAME", choices=list(PRESETS), help="the preset to build")
    build.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="cache root; models go to DIR/models/ (default: $PALAESTRA_CACHE or ~/.cache/palaestra)",
    )
    build.set_defaults(func=_cmd_build)


def _cmd_build(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(resolve_model(args.name, cache_dir=args.cache_dir))
    return 0
