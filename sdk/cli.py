"""`palaestra rollout`, `palaestra eval` and `palaestra session new|reward`.

    palaestra rollout --env math --gateway http://127.0.0.1:8000 --tasks 16 --samples-per-task 4 --concurrency 16
    palaestra eval --env math --gateway http://127.0.0.1:8000 --tasks 200
    palaestra rollout --env math --gateway $GW --tasks 8 --show 2          # the 2 worst episodes as text
    palaestra session new --env my-agent --gateway $GW --api-key $KEY      # a base URL and session token
    palaestra session reward SESSION_ID 1.0 --gateway $GW --api-key $KEY
    palaestra session show SESSION_ID --gateway $GW --api-key $KEY         # its turns as text
    palaestra envs                                                         # environments, datasets, games

The gateway's environment key comes from --api-key or PALAESTRA_API_KEY; it creates sessions and
posts rewards, and an agent never gets it (`session new` prints the session's own token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


def _gateway(args: argparse.Namespace):
    from palaestra.sdk.session import GatewayClient

    key = args.api_key or os.environ.get("PALAESTRA_API_KEY") or "local"
    return GatewayClient(args.gateway, key, retries=args.retries)


EXAMPLE_ARGS = """'{"difficulty": 2}'"""


def _env(args: argparse.Namespace):
    """The environment `--env` names, built with `--env-args`; a bad name, module or argument exits
    with a message saying what to change (no traceback)."""
    from palaestra.plugins import PluginError
    from palaestra.sdk.registry import environment_arguments, environment_class

    command = f"palaestra {args.group}"
    try:
        kwargs = json.loads(args.env_args) if args.env_args else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{command}: --env-args is not JSON ({exc}); e.g. {EXAMPLE_ARGS}") from None
    if not isinstance(kwargs, dict):
        raise SystemExit(f"{command}: --env-args must be a JSON object, e.g. {EXAMPLE_ARGS}")
    try:
        cls = environment_class(args.env)
    except PluginError as exc:
        raise SystemExit(f"{command}: --env: {exc}") from None
    except ImportError as exc:  # a built-in whose optional package is not installed
        raise SystemExit(f"{command}: --env {args.env}: {type(exc).__name__}: {exc}") from None
    takes = environment_arguments(cls)
    problems = [f"{k!r} is not an argument" for k in takes.unknown(kwargs)]
    problems += [f"{k!r} is required (no default)" for k in takes.missing(kwargs)]
    if problems:
        raise SystemExit(
            f"{command}: --env-args: {'; '.join(problems)} of environment {args.env!r} "
            f"({cls.__module__}:{cls.__qualname__}, which takes {takes.signature()})"
        )
    try:
        return cls(**kwargs)
    except Exception as exc:  # the environment's own check of its arguments: its message, one line
        message = " ".join(str(exc).split())
        raise SystemExit(f"{command}: --env-args: {type(exc).__name__}: {message}") from None


def _run(rollouts, command: str = "palaestra"):
    """`asyncio.run(rollouts)`; a task that breaks the task contract, or a gateway that refuses the
    key, exits with its message."""
    from palaestra.sdk.environment import TaskError
    from palaestra.sdk.runner import Refused

    try:
        return asyncio.run(rollouts)
    except TaskError as exc:
        raise SystemExit(f"palaestra: {exc}") from None
    except Refused as exc:
        raise SystemExit(f"{command}: stopped at the first refused episode: {exc}") from None


def _print_summary(summary, json_line: dict | None, args: argparse.Namespace) -> None:
    """The rollouts' failures (the first five; every one's traceback with -v) on stderr, the
    environment's metrics, the episodes `--show` picks, the JSON line."""
    failed = [r for r in summary.results if r.status == "failed"]
    for r in failed if args.verbose else failed[:5]:
        where = f" ({r.where})" if r.where else ""
        print(f"  failed: task {r.task_id} session {r.session_id}: {r.error}{where}", file=sys.stderr)
        if args.verbose and r.traceback:
            print(r.traceback.rstrip(), file=sys.stderr)
    if summary.metrics_line():
        print(summary.metrics_line())
    if args.show:
        _show(args, summary.results)
    if json_line is not None:
        print(json.dumps(json_line))


def _show(args: argparse.Namespace, results) -> None:
    """`--show N`: the episodes `--show-pick` picks, as text from the gateway (sdk/show.py)."""
    from palaestra.sdk.session import GatewayError
    from palaestra.sdk.show import episode_text, pick

    picked = pick(results, args.show, args.show_pick, args.seed)
    gateway = _gateway(args)

    async def run():
        try:
            out = []
            for r in picked:
                try:
                    out.append(await gateway.trajectory(r.session_id) if r.session_id else None)
                except GatewayError as exc:  # the summary stands; this episode is shown without turns
                    print(f"  --show: session {r.session_id}: {exc}", file=sys.stderr)
                    out.append(None)
            return out
        finally:
            await gateway.close()

    for result, trajectory in zip(picked, asyncio.run(run()), strict=True):
        print(episode_text(trajectory, result))


def _roll(args: argparse.Namespace, **options):
    """The tasks `args` picks and their rollouts through the gateway, as `rollout` and `eval` run
    them (`options` go to `run_rollouts`); `eval`'s tasks stratified over the environment's kinds."""
    from palaestra.sdk.runner import StrataError, run_rollouts, stratified_tasks, take_tasks

    env = _env(args)
    if args.group == "eval":
        try:
            tasks = stratified_tasks(env, args.tasks, args.seed)
        except StrataError as exc:
            raise SystemExit(f"palaestra eval: {exc}") from None
    else:
        tasks = take_tasks(env, args.tasks, args.seed)
    gateway = _gateway(args)

    async def run():
        try:
            return await run_rollouts(
                env,
                gateway,
                tasks,
                concurrency=args.concurrency,
                progress=not args.quiet,
                sampling={"temperature": args.temperature},
                label=args.group,
                **options,
            )
        finally:
            await gateway.close()

    return env, tasks, _run(run(), f"palaestra {args.group}")


def _rollout(args: argparse.Namespace) -> int:
    _, _, summary = _roll(args, samples_per_task=args.samples_per_task, seed=args.seed)
    print(summary.line())
    _print_summary(
        summary,
        {
            "reward_mean": summary.reward_mean,
            "reward_std": summary.reward_std,
            "metrics": summary.metrics,
            "statuses": summary.statuses,
            "sampled_tokens": summary.sampled_tokens,
            "wall_s": summary.wall_s,
            "sample_ids": [s for r in summary.results for s in r.sample_ids],
        }
        if args.json
        else None,
        args,
    )
    failed = [r for r in summary.results if r.status == "failed"]
    return 1 if failed and len(failed) == len(summary.results) else 0


def _eval(args: argparse.Namespace) -> int:
    from palaestra.sdk.runner import standard_error, wilson_interval, within_noise
    from palaestra.sdk.scoring import by_kind, score

    env, tasks, summary = _roll(args, samples_per_task=1)
    scores = score(tasks, summary.results)  # as training's evaluations
    acc, n = scores["accuracy"], int(scores["tasks"])
    lo, hi = wilson_interval(acc * n if n else 0.0, n)
    print(
        f"accuracy {acc:.3f} ± {standard_error(acc, n):.3f} s.e. (95% CI {lo:.3f}-{hi:.3f}) on {n} tasks "
        f"({int(scores['failed'])} failed); reward {summary.reward_mean:.3f}; {summary.wall_s:.1f} s"
    )
    kinds = by_kind(tasks, summary.results, env.name)  # every kind, even one, always printed
    per_kind = {}
    for kind, (k_acc, k_n) in kinds.items():
        k_lo, k_hi = wilson_interval(k_acc * k_n if k_n else 0.0, k_n)
        k_se = standard_error(k_acc, k_n)
        print(
            f"  {kind}: accuracy {k_acc:.3f} ± {k_se:.3f} s.e. (95% CI {k_lo:.3f}-{k_hi:.3f}) on {k_n} tasks"
        )
        per_kind[kind] = {"accuracy": k_acc, "se": k_se, "ci95": [k_lo, k_hi], "n": k_n}
    if len(kinds) > 1:
        ranked = sorted((a, k, name) for name, (a, k) in kinds.items() if k > 0)
        differ = len(ranked) > 1 and ranked[0][0] != ranked[-1][0]
        if differ and within_noise(ranked[0][:2], ranked[-1][:2]):
            print(
                f"  note: {ranked[-1][2]} ({ranked[-1][0]:.3f}) and {ranked[0][2]} ({ranked[0][0]:.3f}) "
                "differ by less than two standard errors: within noise on this many tasks"
            )
    _print_summary(
        summary,
        {
            "accuracy": acc,
            "se": standard_error(acc, n),
            "ci95": [lo, hi],
            "n": n,
            "kinds": per_kind,
            "reward_mean": summary.reward_mean,
            "metrics": summary.metrics,
        }
        if args.json
        else None,
        args,
    )
    return 0


def _session_new(args: argparse.Namespace) -> int:
    gateway = _gateway(args)

    async def run():
        try:
            s = await gateway.session(args.env, args.task_id, args.group_id)
            await s.client.close()
            return s
        finally:
            await gateway.close()

    s = asyncio.run(run())
    # The session's own token, not the environment key: it opens this session's routes only.
    print(f"session_id: {s.session_id}\nbase_url:   {s.base_url}\napi_key:    {s.api_key}")
    return 0


def _session_reward(args: argparse.Namespace) -> int:
    gateway = _gateway(args)

    async def run():
        try:
            return await gateway.reward(
                args.session_id, args.value, json.loads(args.metrics or "{}"), args.status
            )
        finally:
            await gateway.close()

    print(json.dumps(asyncio.run(run())))
    return 0


def _session_show(args: argparse.Namespace) -> int:
    from palaestra.sdk.show import episode_text

    gateway = _gateway(args)

    async def run():
        try:
            return await gateway.trajectory(args.session_id)
        finally:
            await gateway.close()

    trajectory = asyncio.run(run())
    print(json.dumps(trajectory) if args.json else episode_text(trajectory))
    return 0


def _envs(args: argparse.Namespace) -> int:
    from palaestra.sdk.catalog import catalog_lines

    print("\n".join(catalog_lines(check=args.check)))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", required=True, help="gateway URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--api-key", default=None, help="the gateway's environment key (default: env PALAESTRA_API_KEY)"
    )
    p.add_argument(
        "--retries", type=int, default=3, help="retries of transient gateway errors (default: %(default)s)"
    )


def _env_args(p: argparse.ArgumentParser) -> None:
    from palaestra.sdk.registry import builtin_names

    p.add_argument(
        "--env",
        required=True,
        help=f"a built-in environment ({builtin_names()}) or package.module:Class, a module in the "
        "working directory or on PYTHONPATH",
    )
    p.add_argument(
        "--env-args",
        default=None,
        help="JSON keyword arguments for the environment, e.g. '{\"difficulty\": 2}'",
    )
    p.add_argument("--tasks", type=int, default=16, help="number of tasks (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the tasks and of each episode's sampling (default: %(default)s)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="sessions at once (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="also print a JSON summary line")
    p.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="print N episodes as text: prompt, each turn's reply and tool results, reward, metrics, "
        "failures (default: none)",
    )
    p.add_argument(
        "--show-pick",
        choices=["worst", "best", "random"],
        default="worst",
        help="which episodes --show prints: the lowest rewards (failed first), the highest, or a "
        "seeded random choice (default: %(default)s)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every failed episode's traceback (file and line)"
    )


def register(groups) -> None:
    p = groups.add_parser(
        "rollout",
        help="run an environment's rollouts through a gateway",
        description="Run K sessions per task (one group each) with bounded concurrency; "
        "prints reward mean/std, per-status counts, sampled tokens, wall time and the mean of every "
        "metric the environment returns.",
    )
    _common(p)
    _env_args(p)
    p.add_argument(
        "--samples-per-task",
        type=int,
        default=4,
        help="sessions per task = group size (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature, in every session's `session.sampling` (default: %(default)s)",
    )
    p.set_defaults(func=_rollout)

    p = groups.add_parser(
        "eval",
        help="accuracy of an environment with a 95%% confidence interval",  # help is %-formatted
        description="One session per task; accuracy from the 'correct' metric (else reward > 0) "
        "with a Wilson 95% interval, the mean reward and the mean of every metric the environment "
        "returns.",  # a description is printed as written
    )
    _common(p)
    _env_args(p)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, in every session's `session.sampling` (default: greedy)",
    )
    p.set_defaults(func=_eval)

    session = groups.add_parser("session", help="sessions for external agents")
    sub = session.add_subparsers(dest="session_cmd", metavar="COMMAND", required=True)
    p = sub.add_parser("new", help="create a session and print its base URL and its own token")
    _common(p)
    p.add_argument("--env", required=True, help="environment name recorded with the samples")
    p.add_argument("--task-id", default="", help="task id recorded with the samples")
    p.add_argument("--group-id", default=None, help="group id (default: env/task_id)")
    p.set_defaults(func=_session_new)
    p = sub.add_parser("reward", help="finish a session with a reward")
    _common(p)
    p.add_argument("session_id")
    p.add_argument("value", type=float)
    p.add_argument("--metrics", default=None, help="JSON object of numbers, e.g. '{\"correct\": 1}'")
    p.add_argument("--status", default="completed", choices=["completed", "failed", "aborted", "truncated"])
    p.set_defaults(func=_session_reward)
    p = sub.add_parser("show", help="print a session's turns as text, with forks and ignored controls")
    _common(p)
    p.add_argument("session_id")
    p.add_argument("--json", action="store_true", help="print the trajectory as JSON (with each turn's text)")
    p.set_defaults(func=_session_show)

    p = groups.add_parser(
        "envs",
        help="the environments, and each family's datasets and games, and why any is unavailable here",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="build every reasoning-gym dataset and TextArena game (~50 s) to say which cannot run here and why",
    )
    p.set_defaults(func=_envs)
