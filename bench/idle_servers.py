"""What an idle engine and gateway cost while nothing is asked of them: CPU and wake-ups a second.
One run, ratios.

    .venv/bin/python -m bench.idle_servers [--seconds 10]

Every figure is read from /proc/PID/task/*/schedstat (CPU nanoseconds and the times the kernel ran
each thread) over `--seconds` after a settling second. Printed:

* `palaestra engine serve --model tiny` and `palaestra gateway serve` in front of it, idle: each
  process's CPU (ms a second) and wake-ups a second, and its busiest threads;
* the same small app served by uvicorn's own `Server` (a 0.1 s tick) and by
  `palaestra.quiet_server.QuietServer` (a tick a second, woken by `should_exit`), each in a
  subprocess: the ratio;
* a thread waiting as the session journal's fsync thread did before it waited for writes
  (`Event.wait(interval_s)` in a loop, 50 ms) beside one waiting as it does now (`Event.wait()`
  until a write): the ratio.

On this machine's virtual CPUs a wake-up costs a process ~0.1-0.15 ms of CPU, so a loop that wakes
to find nothing to do costs something even when idle: a gateway serving one harness at ~3 turns a
second paid its ticks on every turn (docs/gateway.md, "Idle wake-ups").
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import common
from palaestra.engine.cli import engine_process
from palaestra.gateway.cli import gateway_process
from palaestra.net import free_port, wait_http_ok

ENV = {"PALAESTRA_API_KEY": "bench", "PALAESTRA_ADMIN_KEY": "bench-admin"}

APP = """
import sys, uvicorn
from fastapi import FastAPI
from palaestra.quiet_server import QuietServer
app = FastAPI()
@app.get("/health")
def health():
    return {}
kind = QuietServer if sys.argv[2] == "quiet" else uvicorn.Server
kind(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")).run()
"""


def watch(targets: dict[str, tuple[int, list[int] | None]], seconds: float) -> dict[str, dict]:
    """Per label (a pid, and its threads to count or None for all): CPU ms/s, wake-ups/s and the
    busiest threads over `seconds`, after one to settle."""
    time.sleep(1.0)
    before = {label: common.thread_stats(pid, ids) for label, (pid, ids) in targets.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {label: common.thread_stats(pid, ids) for label, (pid, ids) in targets.items()}
    span = time.monotonic() - t0
    out = {}
    for label, (pid, _) in targets.items():
        rows = [
            ((cpu - before[label][tid][0]) / 1e6 / span, (runs - before[label][tid][1]) / span, tid)
            for tid, (cpu, runs) in after[label].items()
            if tid in before[label]
        ]
        rows.sort(reverse=True)
        out[label] = {
            "cpu": sum(r[0] for r in rows),
            "wakeups": sum(r[1] for r in rows),
            "top": [(cpu, w, _name(pid, tid), tid) for cpu, w, tid in rows if w > 0][:4],
        }
    return out


def _name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "?"


def line(label: str, figures: dict) -> str:
    top = ", ".join(f"{name}#{tid % 1000} {cpu:.2f} ms/s {w:.1f}/s" for cpu, w, name, tid in figures["top"])
    return (
        f"{label}: {figures['cpu']:.2f} ms CPU a second, {figures['wakeups']:.1f} wake-ups a second ({top})"
    )


def servers_idle(seconds: float) -> None:
    with (
        engine_process("tiny", extra_args=["--num-threads", "1"]) as engine,
        tempfile.TemporaryDirectory(prefix="bench-idle-") as spool,
        gateway_process("tiny", engine.url, spool, env=ENV) as gw,
    ):
        assert engine.pid is not None and gw.pid is not None
        figures = watch({"engine": (engine.pid, None), "gateway": (gw.pid, None)}, seconds)
    for label, f in figures.items():
        print(line(f"idle {label} (`palaestra {label} serve`, tiny)", f))


def uvicorn_vs_quiet(seconds: float) -> None:
    procs, pids = [], {}
    try:
        for kind in ("uvicorn", "quiet"):
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-c", APP, str(port), kind])
            procs.append(proc)
            wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
            pids[kind] = (proc.pid, None)
        figures = watch(pids, seconds)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    u, q = figures["uvicorn"], figures["quiet"]
    print(line("a small app on uvicorn.Server", u))
    print(line("the same on QuietServer", q))
    print(
        f"QuietServer / uvicorn.Server: CPU {q['cpu'] / u['cpu']:.2f}x, wake-ups {q['wakeups'] / u['wakeups']:.2f}x"
    )


def waiting_threads(seconds: float) -> None:
    stop, write = threading.Event(), threading.Event()

    def polling() -> None:  # the fsync thread as it was: woken every 50 ms
        while not stop.wait(0.05):
            pass

    def waiting() -> None:  # as it is: asleep until a write
        while True:
            write.wait()
            if stop.is_set():
                return

    started = [threading.Thread(target=fn, daemon=True) for fn in (polling, waiting)]
    for t in started:
        t.start()
    figures = watch({t.name: (os.getpid(), [t.native_id]) for t in started}, seconds)
    stop.set()
    write.set()
    (p_cpu, p_runs), (w_cpu, w_runs) = ((figures[t.name]["cpu"], figures[t.name]["wakeups"]) for t in started)
    print(
        f"the journal's fsync thread, idle: polling every 50 ms (as before) {p_cpu:.2f} ms CPU a second, "
        f"{p_runs:.1f} wake-ups a second; waiting for a write (now) {w_cpu:.3f} ms, {w_runs:.1f} wake-ups"
    )


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each idle process is watched")
    args = ap.parse_args()
    if args.seconds <= 0:
        ap.error(f"--seconds must be more than 0; got {args.seconds}")
    servers_idle(args.seconds)
    uvicorn_vs_quiet(args.seconds)
    waiting_threads(args.seconds)


if __name__ == "__main__":
    main()
