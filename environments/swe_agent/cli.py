"""`palaestra swe generate`, `palaestra swe validate` and `palaestra swe fetch`.

    palaestra swe generate --out swe.jsonl            # plants bugs in the bundled repos, keeps the valid ones
    palaestra swe generate --out real.jsonl --real    # ... in real packages' sdists (their own pytest suites)
    palaestra swe validate swe.jsonl --backend local  # one JSON line per instance; exit 1 if any is invalid
    palaestra swe fetch                               # pytest's wheels and the real sdists, for offline use

``--backend`` is a sandbox spec ("local", "docker", a remote URL) or ``package.module:Class``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path


def _env_options(args: argparse.Namespace):
    from palaestra.environments.swe_agent.repo_env import EnvOptions

    return EnvOptions(args.env_cache_dir, tuple(args.find_links or ()), not args.no_index)


def _fetch(args: argparse.Namespace) -> int:
    import importlib.metadata
    import subprocess

    from palaestra.environments.swe_agent.generate import REAL_PACKAGES
    from palaestra.environments.swe_agent.repo_env import packages_dir

    out = Path(args.dest) if args.dest else packages_dir()
    pytest = f"pytest=={importlib.metadata.version('pytest')}"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--dest", str(out)]
    for extra, requirements in (
        (["--only-binary", ":all:"], [pytest]),
        (["--no-deps", "--no-binary", ":all:"], list(REAL_PACKAGES)),
    ):
        done = subprocess.run([*pip, *extra, *requirements])
        if done.returncode != 0:
            print(f"error: pip download {' '.join(requirements)} failed", file=sys.stderr)
            return 1
    print(json.dumps({"dest": str(out), "files": sorted(p.name for p in out.iterdir())}))
    return 0


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
                result = await validate(instance, backend, env_options=_env_options(args))
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
    from palaestra.environments.swe_agent.generate import REAL_PACKAGES, generate, sdist_source
    from palaestra.environments.swe_agent.repo_env import packages_dir

    sdists = [Path(p) for p in args.sdists or ()]
    if args.real:
        for requirement in REAL_PACKAGES:
            name, version = requirement.split("==")
            found = sorted(packages_dir().glob(f"{name.replace('-', '_')}-{version}.tar.gz"))
            found += sorted(packages_dir().glob(f"{name}-{version}.tar.gz"))
            if not found:
                print(
                    f"error: no {name}-{version}.tar.gz in {packages_dir()}: run `palaestra swe fetch`",
                    file=sys.stderr,
                )
                return 2
            sdists.append(found[0])
    try:
        sources = [sdist_source(p) for p in sdists] or None
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = resolve_backend(args.backend)

    async def run():
        try:
            return await generate(
                Path(args.out),
                backend,
                seed=args.seed,
                per_kind=args.per_kind,
                repos=args.repos or None,
                sources=sources,
                tries_per_kind=args.tries_per_kind,
                env_options=_env_options(args),
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
    swe = groups.add_parser("swe", help="SWE task instances: generate, validate, fetch")
    commands = swe.add_subparsers(dest="swe_command", metavar="COMMAND", required=True)

    validate = commands.add_parser("validate", help="validate every instance of a SWE-bench-style JSONL")
    validate.add_argument("file", help="the JSONL (fields: instance_id, repo, base_commit, patch, ...)")
    validate.add_argument("--backend", default="local", help="sandbox backend spec (default: local)")
    validate.add_argument("--concurrency", type=int, default=2, help="instances validated at once")
    _env_flags(validate)
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
    gen.add_argument("--sdists", nargs="*", help="real packages' source distributions (.tar.gz) instead")
    gen.add_argument(
        "--real", action="store_true", help="the sdists `palaestra swe fetch` downloaded instead"
    )
    gen.add_argument(
        "--tries-per-kind", type=int, default=12, help="mutants tried per bug kind per repository"
    )
    _env_flags(gen)
    gen.add_argument("--concurrency", type=int, default=4, help="mutants tested at once")
    gen.add_argument("-v", "--verbose", action="store_true", help="print each candidate's validation")
    gen.set_defaults(func=_generate)

    fetch = commands.add_parser(
        "fetch", help="download pytest's wheels and the real packages' sdists, for offline environments"
    )
    fetch.add_argument("--dest", help="where (default: ~/.cache/palaestra/swe/packages)")
    fetch.set_defaults(func=_fetch)


def _env_flags(parser: argparse.ArgumentParser) -> None:
    """How instances' environments (environments/swe_agent/repo_env.py) are built."""
    parser.add_argument(
        "--env-cache-dir", help="where environments live (default: ~/.cache/palaestra/swe/envs)"
    )
    parser.add_argument("--find-links", nargs="*", help="directories of wheels and sdists pip may use")
    parser.add_argument("--no-index", action="store_true", help="pip may not ask the package index (offline)")
