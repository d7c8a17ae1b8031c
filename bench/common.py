"""What the benchmarks share: their command line, one `palaestra train` run of a config (started
again when Ray's own node fails to start: `retry_ray_start`), its metrics
rows, and a side-by-side table.

Benchmarks are run from the repository root as modules, `.venv/bin/python -m bench.NAME`, so
`bench.*` and `tests.support.*` import without touching `sys.path`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from palaestra.config import load_config
from palaestra.orchestrator.loop import Hook, RunResult
from palaestra.train import train

if TYPE_CHECKING:
    from palaestra.gateway.service import GatewayService

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"
MODES = ("sync", "one_step_off", "async")
T = TypeVar("T")


# -- a gateway bench on the zero-work engine -----------------------------------------------------
def run_on_zero_engine(
    reply: str, where: str, prefix: str, body: Callable[[str, Any, Path], Awaitable[None]]
) -> None:
    """`body(engine_url, tokenizer, root)` against the zero-work engine answering `reply` (tiny's
    tokens, then its end of turn), `root` a fresh folder under `where` (the disk measured), removed
    afterwards."""
    import asyncio
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from palaestra.models import resolve_model
    from palaestra.testing import zero as zero_engine

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    ids = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    zero = zero_engine.process("--reply-ids", *map(str, ids))
    Path(where).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
    try:
        with zero:
            asyncio.run(body(zero.url, tok, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def gateway_service(
    engine_url: str, tok: Any, spool_dir: Path, journal_fsync: str = "off", share_prefixes: bool = True
) -> GatewayService:
    """An in-process `GatewayService` for `tiny` (32k context, no keys) in front of `engine_url`, its
    spool and journal in `spool_dir`: `journal_fsync` as the gateway's option, `share_prefixes` for
    both the spool and the journal (a fork stored against what it shares, or whole)."""
    from palaestra.gateway.app import build_service
    from palaestra.gateway.config import GatewayConfig
    from palaestra.gateway.engine_side.engine_client import EngineClient
    from palaestra.gateway.sessions.spool import SampleSpool

    config = GatewayConfig(
        model="tiny",
        engine_url=engine_url,
        spool_dir=str(spool_dir),
        insecure_local=True,
        context_length=32768,
        journal_fsync=journal_fsync,
    )
    svc = build_service(
        config,
        tok,
        32768,
        EngineClient(engine_url),
        SampleSpool(config.spool_dir, share_prefixes=share_prefixes),
    )
    svc.journal.share_prefixes = share_prefixes
    return svc


# -- the command line ---------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring is the --help text, printed as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_args(
    ap: argparse.ArgumentParser, steps: int | None, modes: Sequence[str] = MODES, what: str = "mode"
) -> None:
    """`--steps` (None: the benchmark picks), `--modes` and trailing dotted config overrides, for
    benchmarks of training runs."""
    default = "the config's" if steps is None else "%(default)s"
    ap.add_argument(
        "--steps", type=int, default=steps, help=f"training steps per {what} (default: {default})"
    )
    ap.add_argument(
        "--modes",
        default=",".join(modes),
        help="comma-separated: sync, one_step_off, async (default: %(default)s)",
    )
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides, e.g. env.tasks_per_step=8")


def csv(text: str) -> list[str]:
    """A comma-separated option as a list, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


# -- a run and its metrics ----------------------------------------------------------------------
def train_config(
    config: Path, out: Path, name: str, overrides: Sequence[str], hook: Hook | None = None
) -> RunResult:
    """`config` with `overrides`, written to `out`: only the last step checkpointed, no TensorBoard.
    The per-step metrics (what metrics.jsonl holds) are `result.state.rows`; held-out accuracy is
    in the rows that carry `eval/accuracy` (step 0: before training). `hook`: `train`'s."""
    settings = [f"run.output_dir={out}", f"run.name=bench-{name}", "run.checkpoint_every=0",
                "logging.tensorboard_dir=null"]  # fmt: skip
    cfg = load_config(config, [*settings, *overrides])
    stepped = False  # once a step began, no failure is Ray's start any more

    def seen(phase: str, step: int, run: Any) -> None:
        nonlocal stepped
        stepped = True
        if hook is not None:
            hook(phase, step, run)

    return retry_ray_start(lambda: train(cfg, hook=seen), f"run {name}", began=lambda: stepped)


# What Ray raises when its own node does not come up in time (ray.init and ray.cluster_utils on a
# loaded machine: the raylet or the GCS missing Ray's start-up deadline); nothing a run does.
RAY_START_FAILURES = (
    "timed out during startup",  # the raylet did not register with the GCS within Ray's 30 s
    "while waiting for node to startup",
    "may not have started successfully",  # the head's GCS or raylet
    "Failed to start GCS",
)


def ray_start_failed(exc: BaseException) -> bool:
    """Whether `exc` is Ray failing to start its local node (`RAY_START_FAILURES`)."""
    return any(part in str(exc) for part in RAY_START_FAILURES)


def retry_ray_start(
    start: Callable[[], T], what: str, tries: int = 3, began: Callable[[], bool] | None = None
) -> T:
    """`start()` (a run, or a Ray cluster), started again when Ray failed to start its node, with
    a one-line note on stderr naming the error, at most `tries` times in all. Any other failure,
    or one after `began()` says the run got past its start (a step ran), is raised as it is."""
    attempt = 1
    while True:
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception for its start-up timeout)
            if attempt >= tries or (began is not None and began()) or not ray_start_failed(exc):
                raise
            attempt += 1
            first = str(exc).strip().splitlines()[0]
            print(f"{what}: Ray did not start ({type(exc).__name__}: {first}); starting it again "
                  f"(try {attempt} of {tries})", file=sys.stderr, flush=True)  # fmt: skip


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean over seeds or runs (0 for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


def train_demo(out: Path, name: str, overrides: Sequence[str], hook: Hook | None = None) -> RunResult:
    """configs/demo.yaml through `train_config`."""
    return train_config(CONFIG, out, name, overrides, hook)


def step_rows(result: RunResult, key: str = "perf/step_wall_s") -> list[dict]:
    """The metrics rows of the training steps (those carrying `key`), in order."""
    return [row for row in result.state.rows if key in row]


def total(rows: Iterable[dict], key: str) -> float:
    return sum(row.get(key, 0.0) for row in rows)


def mean(rows: Iterable[dict], key: str) -> float:
    """The mean of `key` over the rows that have it (NaNs left out); NaN when none has."""
    vals = [row[key] for row in rows if key in row and not math.isnan(row[key])]
    return statistics.fmean(vals) if vals else float("nan")


def median(rows: Iterable[dict], value: Callable[[dict], float]) -> float:
    vals = [value(row) for row in rows]
    return statistics.median(vals) if vals else float("nan")


# -- a process's threads, from the kernel's scheduler statistics ----------------------------------
def thread_stats(pid: int, native_ids: Sequence[int] | None = None) -> dict[int, tuple[int, int]]:
    """Thread id -> (CPU nanoseconds, times the kernel ran it) for each thread of `pid` (or for those
    of `native_ids`), from /proc/PID/task/TID/schedstat; a thread that just ended is left out."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        if native_ids is not None and tid not in native_ids:
            continue
        try:
            fields = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[tid] = (int(fields[0]), int(fields[2]))
    return out


# -- starting a server, one kind against another -----------------------------------------------
START_COLUMNS = ("wall s", "cpu s", "rss MB")


def process_start_figures(pid: int) -> dict[str, float]:
    """A started server process's CPU time (every thread) and resident memory, read now."""
    from bench.gateway import cpu_seconds

    with open(f"/proc/{pid}/status") as status:
        rss = int(status.read().split("VmRSS:")[1].split()[0]) / 1024
    return {"cpu s": cpu_seconds(pid), "rss MB": rss}


def start_bench_args(doc: str | None) -> argparse.Namespace:
    """The start benches' command line (--model, --rounds), checked, with the preset built once
    before anything is timed."""
    from palaestra.models import resolve_model

    ap = parser(doc)
    ap.add_argument("--model", default="tiny", help="preset name or model directory (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="starts of each kind (default: %(default)s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more; got {args.rounds}")
    resolve_model(args.model)
    return args


def alternating_starts(
    kinds: Sequence[str], rounds: int, start: Callable[[str, int], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """`start(kind, round)` for each kind, `rounds` times, the order reversed every other round
    (a machine drifts over a run); each start printed as it ends. Every start's dict carries
    START_COLUMNS, and may carry more (printed too)."""
    if sys.flags.dont_write_bytecode:  # the Makefile unexports it for `make test`; a shell may set it
        print(
            "note: PYTHONDONTWRITEBYTECODE is set, so every start compiles what it imports from source "
            "(about 1.7x an engine's start): unset it to measure what `make` and CI run",
            flush=True,
        )
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
            run = start(kind, r)
            runs[kind].append(run)
            extra = ", ".join(f"{k}: {v}" for k, v in run.items() if k not in START_COLUMNS)
            print(
                f"round {r + 1} {kind:13s}: ready in {run['wall s']:.2f} s, CPU {run['cpu s']:.2f} s, "
                f"RSS {run['rss MB']:.0f} MB" + (f", {extra}" if extra else ""),
                flush=True,
            )
    return runs


def start_summary(title: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    """The medians per kind, and the first kind over the second (ready, CPU, RSS)."""
    med = {kind: {k: statistics.median(float(r[k]) for r in rs) for k in START_COLUMNS} for kind, rs in runs.items()}  # fmt: skip
    lines = [title, f"{'':15s}{'ready s':>9s}{'CPU s':>8s}{'RSS MB':>8s}"]
    for kind, m in med.items():
        lines.append(f"{kind:15s}{m['wall s']:9.2f}{m['cpu s']:8.2f}{m['rss MB']:8.0f}")
    (ka, a), (kb, b) = list(med.items())[:2]
    lines.append(
        f"{ka} / {kb}: ready {a['wall s'] / b['wall s']:.2f}x, CPU {a['cpu s'] / b['cpu s']:.2f}x, "
        f"RSS {a['rss MB'] / b['rss MB']:.2f}x ({b['rss MB'] - a['rss MB']:.0f} MB less)"
    )
    return "\n".join(lines)


# -- the table ----------------------------------------------------------------------------------
def table(
    title: str, columns: Sequence[tuple[str, str]], rows: dict[str, dict[str, object]], key: str = "run"
) -> str:
    """Runs side by side: one line per run (its name first, under `key`), one column per
    `(name, format)`; a value a run lacks prints as `-`."""
    cells = {run: [format(v[c], f) if c in v else "-" for c, f in columns] for run, v in rows.items()}
    widths = [max([len(c), *(len(cs[i]) for cs in cells.values())]) for i, (c, _) in enumerate(columns)]
    first = max([len(key), *map(len, rows)])
    lines = [
        title,
        f"{key:{first}s} " + " ".join(f"{c:>{w}s}" for (c, _), w in zip(columns, widths, strict=True)),
    ]
    for run, cs in cells.items():
        lines.append(f"{run:{first}s} " + " ".join(f"{x:>{w}s}" for x, w in zip(cs, widths, strict=True)))
    return "\n".join(lines)
