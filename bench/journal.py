"""Session journal benchmark, one run, ratios: what journaling every turn costs the gateway.

    .venv/bin/python -m bench.journal [--sessions 20] [--turns 16]

Four gateway cores (`GatewayService`, in this process) over one zero-work engine
(`python -m palaestra.testing.zero`): without a journal (its writes replaced by no-ops, for this measurement
only), and with `journal_fsync` off, batch (50 ms) and always. Sessions of `--turns` chat turns
(the history grows, each turn bridged onto the last) run interleaved session by session, so the
machine's noise hits every variant alike. Printed: the median wall time and process CPU time per
turn of each variant, and each journaled variant's extra per turn over no journal, as a ratio;
the time of the journal's own `turn()` call, and its bytes per turn. The wall time includes the engine round trip on loopback; the
CPU time is the gateway's own work (the fsync thread of `batch` included).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench import common
from palaestra.gateway.routes import OPENAI_CHAT
from palaestra.gateway.service import GatewayService

VARIANTS = ("none", "off", "batch", "always")


class NoJournal:
    """The journal's interface doing nothing: the 'without' side of the comparison."""

    bytes = 0

    def opened(self, *a: Any) -> None: ...
    def turn(self, *a: Any) -> None: ...
    def failed(self, *a: Any) -> None: ...
    def finished(self, *a: Any) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...


async def session(svc: GatewayService, turns: int, wall: list[float], cpu: list[float]) -> None:
    sid = svc.create_session("bench", "t", None, {}).session_id
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Say something short about {i}."})
        t0, c0 = time.perf_counter(), time.process_time()
        answer = await svc.chat(sid, {"model": "tiny", "messages": messages, "max_tokens": 8}, OPENAI_CHAT)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    await svc.finish(sid, 1.0, {}, "completed")


async def run(args: argparse.Namespace, engine_url: str, tok: Any, root: Path) -> None:
    services: dict[str, GatewayService] = {}
    for name in VARIANTS:
        svc = common.gateway_service(engine_url, tok, root / name, "off" if name == "none" else name)
        if name == "none":
            svc.journal.close()
            svc.journal = svc.turns.journal = NoJournal()  # type: ignore[assignment]
        services[name] = svc
    direct: list[float] = []  # the journal's own time per turn record, timed inside the "off" variant
    record = services["off"].journal.turn

    def timed_turn(*a: Any) -> None:
        t0 = time.perf_counter()
        record(*a)
        direct.append(time.perf_counter() - t0)

    services["off"].journal.turn = timed_turn  # type: ignore[method-assign]
    wall: dict[str, list[float]] = {n: [] for n in VARIANTS}
    cpu: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for svc in services.values():  # warm-up
        await session(svc, 4, [], [])
    for _ in range(args.sessions):
        for name, svc in services.items():
            await session(svc, args.turns, wall[name], cpu[name])
    turns = args.sessions * args.turns
    med_w = {n: statistics.median(v) for n, v in wall.items()}
    med_c = {n: statistics.median(v) for n, v in cpu.items()}
    print(
        f"{args.sessions} sessions x {args.turns} turns per variant, interleaved; "
        f"journal on {root} ({shutil.disk_usage(root).total >> 30} GiB filesystem)"
    )
    for name in VARIANTS:
        line = f"  {name:>6}: {med_w[name] * 1e3:6.3f} ms wall, {med_c[name] * 1e3:6.3f} ms CPU per turn"
        if name != "none":
            line += (
                f"; over no journal: wall {med_w[name] / med_w['none']:.3f}x "
                f"({(med_w[name] - med_w['none']) * 1e3:+.3f} ms), CPU {med_c[name] / med_c['none']:.3f}x "
                f"({(med_c[name] - med_c['none']) * 1e3:+.3f} ms)"
            )
        print(line)
    journal = services["off"].journal
    print(
        f"journal: SessionJournal.turn() takes {statistics.median(direct) * 1e6:.1f} us per turn (median), "
        f"{statistics.median(direct) / med_c['none']:.3f}x the gateway's CPU per turn without a journal; "
        f"{journal.bytes / (turns + 4):.0f} bytes per turn written "
        f"(incl. open/finish records), {services['always'].journal.fsyncs} fsyncs with always, "
        f"{services['batch'].journal.fsyncs} with batch"
    )
    for svc in services.values():
        await svc.turns.engine.close()
        svc.close()
        svc.spool.close()


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--sessions", type=int, default=20, help="sessions per variant")
    ap.add_argument("--turns", type=int, default=16, help="turns per session")
    ap.add_argument("--dir", default="runs", help="where the spool directories go (the disk measured)")
    args = ap.parse_args()

    common.run_on_zero_engine(
        "Sure, here it is.", args.dir, "bench-journal-", lambda url, tok, root: run(args, url, tok, root)
    )


if __name__ == "__main__":
    main()
