"""`palaestra swe generate` and `palaestra swe validate`.

    palaestra swe generate --out swe.jsonl            # plants bugs in the bundled repos, keeps the valid ones
    palaestra swe validate swe.jsonl --backend local  # one JSON line per instance; exit 1 if any is invalid

``--backend`` is a sandbox spec ("local", "docker", a remote URL) or ``package.module:Class``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path


def _validate(args: argparse.Namespace) -> int:
    from palaestra.environments.episode import resolve_backend
    from palaestra.environments.swe_agent.grading import Validation, validate
    from palaestra.environments.swe_agent.instance import InstanceError, load_jsonl

    try:
        instances = load_jsonl(args.file)
    except (InstanceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = resolve_backend(args.backend)

    async def run() -> list[Validation]:
        sem = asyncio.Semaphore(args.concurrency)

        async def one(instance):
            async with sem:
                result = await validate(instance, backend)
            print(json.dumps(result.to_json()), flush=True)
            return result

        try:
            return await asyncio.gather(*[one(i) for i in instances])
        finally:
            await backend.close()

    results = asyncio.run(run())
    invalid = sum(not r.valid for r in results)
    print(f"{len(results) - invalid}/{len(results)} instances valid", file=sys.stderr)
    return 1 if invalid else 0


def _generate(args: argparse.Namespace) -> int:
    from palaestra.environments.episode import resolve_backend
    from palaestra.environments.swe_agent.generate import generate

    backend = resolve_backend(args.backend)

    async def run():
        try:
            return await generate(
                Path(args.out),
                backend,
                seed=args.seed,
                per_kind=args.per_kind,
                repos=args.repos or None,
                concurrency=args.concurrency,
                progress=(lambda line: print(line, file=sys.stderr)) if args.verbose else None,
            )
        finally:
            await backend.close()

    instances = asyncio.run(run())
    kinds = Counter(i.bug_kind for i in instances)
    repos = Counter(i.instance_id.split("__")[0] for i in instances)
    print(json.dumps({"out": args.out, "instances": len(instances), "by_kind": kinds, "by_repo": repos}))
    return 0 if instances else 1


def register(groups: argparse._SubParsersAction) -> None:
    swe = groups.add_parser("swe", help="SWE task instances: generate, validate")
    commands = swe.add_subparsers(dest="swe_command", metavar="COMMAND", required=True)

    validate = commands.add_parser("validate", help="validate every instance of a SWE-bench-style JSONL")
    validate.add_argument("file", help="the JSONL (fields: instance_id, repo, base_commit, patch, ...)")
    validate.add_argument("--backend", default="local", help="sandbox backend spec (default: local)")
    validate.add_argument("--concurrency", type=int, default=2, help="instances validated at once")
    validate.set_defaults(func=_validate)

    gen = commands.add_parser(
        "generate", help="plant bugs in the bundled repositories; write the valid instances"
    )
    gen.add_argument(
        "--out", required=True, help="the JSONL to write; repositories go to <stem>.repos/ beside it"
    )
    gen.add_argument("--backend", default="local", help="sandbox backend spec (default: local)")
    gen.add_argument("--seed", type=int, default=0, help="which mutations are tried first")
    gen.add_argument("--per-kind", type=int, default=3, help="instances per bug kind per repository")
    gen.add_argument("--repos", nargs="*", help="bundled repositories to use (default: all)")
    gen.add_argument("--concurrency", type=int, default=4, help="mutants tested at once")
    gen.add_argument("-v", "--verbose", action="store_true", help="print each candidate's validation")
    gen.set_defaults(func=_generate)
