"""``python -m palaestra.sandbox exec|serve ...``: the sandbox commands without the rest of the
``palaestra`` CLI, whose other groups import the engine, gateway and trainer. The exec server's
image runs this with a bare system python: ``python3 -m palaestra.sandbox serve --host 0.0.0.0``.
"""

from __future__ import annotations

import argparse
import sys

from palaestra.sandbox.cli import add_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m palaestra.sandbox", description="Isolated execution of model-written code."
    )
    add_commands(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
