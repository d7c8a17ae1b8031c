"""`palaestra harbor validate PATH`: run each Harbor task's oracle and an empty attempt; keep the
tasks where the oracle scores full and the empty attempt does not.

    palaestra harbor validate environments/harbor/examples            # one line per task, why
    palaestra harbor validate my-tasks --backend docker --out valid/   # copies the valid ones there

Exit status 1 when any task is invalid. ``--backend`` is a sandbox spec ("local", "docker") or
``package.module:Class``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path


def _validate(args: argparse.Namespace) -> int:
    from palaestra.environments.episode import resolve_backend
    from palaestra.environments.harbor.validate import validate_task

    root = Path(args.path)
    if not root.is_dir():
        print(
            f"error: {args.path} is not a directory (a Harbor task, or a directory of them)", file=sys.stderr
        )
        return 2
    dirs = (
        [root]
        if (root / "task.toml").is_file()
        else sorted(p for p in root.iterdir() if (p / "task.toml").is_file())
    )
    if not dirs:
        print(f"error: {args.path} holds no task.toml, nor any directory with one", file=sys.stderr)
        return 2
    backend = resolve_backend(args.backend)

    async def run():
        sem = asyncio.Semaphore(args.concurrency)

        async def one(path: Path):
            async with sem:
                result = await validate_task(path, backend, reward_key=args.reward_key)
            mark = "valid  " if result.valid else "INVALID"
            print(f"{mark} {result.task_id}: {result.reason}", flush=True)
            if args.json:
                print(json.dumps(result.to_json()), flush=True)
            return path, result

        try:
            return await asyncio.gather(*[one(d) for d in dirs])
        finally:
            await backend.close()

    results = asyncio.run(run())
    valid = [path for path, r in results if r.valid]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for path in valid:
            shutil.copytree(path, out / path.name, dirs_exist_ok=True)
    print(
        f"{len(valid)}/{len(results)} tasks valid" + (f"; copied to {args.out}" if args.out else ""),
        file=sys.stderr,
    )
    return 0 if len(valid) == len(results) else 1


def register(groups: argparse._SubParsersAction) -> None:
    harbor = groups.add_parser("harbor", help="Harbor task directories: validate")
    commands = harbor.add_subparsers(dest="harbor_command", metavar="COMMAND", required=True)
    validate = commands.add_parser(
        "validate",
        help="run each task's oracle and an empty attempt; keep those the oracle solves and the empty does not",
    )
    validate.add_argument("path", help="a Harbor task directory, or a directory of them")
    validate.add_argument("--backend", default="local", help="sandbox backend spec (default: local)")
    validate.add_argument("--concurrency", type=int, default=2, help="tasks validated at once")
    validate.add_argument("--out", help="copy the valid tasks into this directory")
    validate.add_argument(
        "--reward-key", help="the primary reward of a reward.json with several and no 'reward'"
    )
    validate.add_argument("--json", action="store_true", help="also print each result as a JSON line")
    validate.set_defaults(func=_validate)
