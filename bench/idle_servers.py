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


def threads(pid: int, native_ids: list[int] | None = None) -> dict[int, tuple[int, int, str]]:
    """thread id -> (CPU ns, times run, name) of `pid`'s threads (or of these threads of it)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        if native_ids is not None and int(task.name) not in native_ids:
            continue
        try:
            fields = (task / "schedstat").read_text().split()
            name = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
        out[int(task.name)] = (int(fields[0]), int(fields[2]), name)
    return out


def watch(pids: dict[str, int], seconds: float) -> dict[str, dict]:
    """Per label: CPU ms/s, wake-ups/s and the busiest threads over `seconds` (after one to settle)."""
    time.sleep(1.0)
    before = {label: threads(pid) for label, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {label: threads(pid) for label, pid in pids.items()}
    span = time.monotonic() - t0
    out = {}
    for label in pids:
        rows = []
        for tid, (cpu, runs, name) in after[label].items():
            if tid in before[label]:
                cpu0, runs0, _ = before[label][tid]
                rows.append(((cpu - cpu0) / 1e6 / span, (runs - runs0) / span, name, tid))
        rows.sort(reverse=True)
        out[label] = {
            "cpu": sum(r[0] for r in rows),
            "wakeups": sum(r[1] for r in rows),
            "top": [r for r in rows if r[1] > 0][:4],
        }
    return out


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
        figures = watch({"engine": engine.pid, "gateway": gw.pid}, seconds)
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
            pids[kind] = proc.pid
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
    time.sleep(0.2)
    ids = [t.native_id for t in started]
    time.sleep(1.0)
    before = threads(os.getpid(), ids)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = threads(os.getpid(), ids)
    span = time.monotonic() - t0
    stop.set()
    write.set()
    (p_cpu, p_runs), (w_cpu, w_runs) = (
        ((after[i][0] - before[i][0]) / 1e6 / span, (after[i][1] - before[i][1]) / span) for i in ids
    )
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
