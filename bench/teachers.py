"""Teacher snapshots under a tight host budget: what prefetch hides, and each tier's bandwidth.

    .venv/bin/python -m bench.teachers                  # 128 MB of weights, 6 steps
    .venv/bin/python -m bench.teachers --mb 256 --steps 8

A step of a two-teacher OPD run switches the model to teacher/a, scores, switches to teacher/b,
scores, switches back to the actor and trains (`SnapshotStore.plan` tells the store that order).
Here the host budget is two copies of the weights: the actor's and ONE teacher's, so every step
brings both teachers back from the disk tier. "Scoring" and "training" are real forward passes of
the model (fp32 Linear layers, `--mb` MB of weights) on one thread, so the prefetch thread has a
core of its own. The same steps run with and without prefetch, interleaved, on two stores with
their own spill files; the bench prints the switch time of each, their ratio, and the share of
the disk load time prefetch hid (goal >= 80 %).

Then each tier's bandwidth against a plain copy of the same bytes (goal >= 50 %):
host -> live (`switch` restore) and live -> host (`save`) against one `torch` copy of a flat
buffer; disk -> host (`read_spill`, memory-mapped) against `readinto` of the same file; host ->
disk (`write_spill`) against one `write` of the same bytes. Spill files live in the page cache
(nothing calls fsync), so the disk tier is measured as the page cache serves it — on a cold
cache both sides would be bound by the device instead.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from palaestra.trainer.snapshot_tiers import Layout, read_spill, spill_path, write_spill
from palaestra.trainer.snapshots import SnapshotStore


def make_model(mb: int, width: int = 1024) -> torch.nn.Sequential:
    layers = max(1, mb * 1_000_000 // (4 * width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Run:
    """One model + store + the step loop; `step()` returns the seconds spent inside `switch`."""

    def __init__(self, mb: int, spill_dir: Path, prefetch: bool, tokens: int):
        torch.manual_seed(0)
        self.model = make_model(mb)
        probe = SnapshotStore(self.model)
        self.store = SnapshotStore(
            self.model, host_budget_bytes=2 * probe.nbytes, spill_dir=spill_dir, prefetch=prefetch
        )
        for i, tag in enumerate(("teacher/a", "teacher/b")):
            self.store.load(tag, perturbed(self.model, i))
        self.x = torch.randn(tokens, 1024)

    @torch.no_grad()
    def compute(self) -> None:
        self.model(self.x)

    def step(self) -> float:
        order = ["teacher/a", "teacher/b", "actor"]
        switching = 0.0
        for tag in order:
            t0 = time.perf_counter()
            self.store.switch(tag)
            switching += time.perf_counter() - t0
            if tag == "actor":  # the next step's order is known now: prefetch during training
                self.store.plan(order)
            self.compute()  # scoring with a teacher, or the actor's training pass
        with torch.no_grad():  # the optimizer step: the actor changes in place
            next(self.model.parameters()).add_(1e-3)
        self.store.mark_live_changed()
        return switching


def prefetch_bench(args: argparse.Namespace, root: Path) -> None:
    runs = {p: Run(args.mb, root / f"prefetch-{p}", p, args.tokens) for p in (True, False)}
    for run in runs.values():  # warm-up: every teacher has been spilled and read back once
        run.step()
        run.step()
        run.store.stats()
    switch = dict.fromkeys(runs, 0.0)
    stats = {p: {} for p in runs}
    compute = best_of(runs[True].compute, 3)
    for _ in range(args.steps):
        for p, run in runs.items():
            switch[p] += run.step()
            for k, v in run.store.stats().items():
                stats[p][k] = stats[p].get(k, 0.0) + v
    nbytes = runs[True].store.nbytes
    print(f"{nbytes / 1e6:.0f} MB of weights, host budget = 2 copies (actor + one teacher), 2 teachers, "
          f"{args.steps} steps of 3 switches; one forward pass = {compute * 1e3:.0f} ms")  # fmt: skip
    for p in (False, True):
        s = stats[p]
        print(f"  prefetch {'on ' if p else 'off'}: switch time {switch[p] / args.steps * 1e3:7.1f} ms/step, "
              f"disk->host {s['perf/snap_disk_to_host_mb'] / args.steps:.0f} MB/step "
              f"({s['perf/snap_disk_load_s'] / args.steps * 1e3:.1f} ms/step of loading), "
              f"host->disk {s['perf/snap_host_to_disk_mb'] / args.steps:.0f} MB/step")  # fmt: skip
    on = stats[True]
    hidden = on["perf/snap_prefetch_hidden_s"] / max(on["perf/snap_disk_load_s"], 1e-12)
    print(f"  -> switch time with prefetch / without = {switch[True] / switch[False]:.3f}; "
          f"prefetch hid {hidden:.1%} of the disk load time (goal >= 80 %)")  # fmt: skip
    for run in runs.values():
        run.store.close()


def tier_bench(args: argparse.Namespace, root: Path) -> None:
    model = make_model(args.mb)
    store = SnapshotStore(model)  # no budget: every tag in host memory
    store.load("teacher/a", perturbed(model, 0))
    store.save("actor")
    nbytes = store.nbytes
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)

    def restore_round_trip() -> None:  # two restores, no saves: both tags keep valid host copies
        store.switch("teacher/a")
        store.switch("actor")

    slot = Layout.of(list(model.named_parameters())).allocate(pin=torch.cuda.is_available())
    path = spill_path(root, "bench")
    write_spill(path, slot, "bench")
    plain_file = root / "plain.bin"
    raw = memoryview(src.view(torch.uint8).numpy())

    def plain_write() -> None:
        with open(plain_file, "wb") as f:
            f.write(raw)

    def plain_read() -> None:
        with open(plain_file, "rb") as f:
            f.readinto(raw)

    ops = {
        "plain_copy": lambda: dst.copy_(src),
        "restore": restore_round_trip,
        "save": lambda: store.save("old_actor"),
        "write": lambda: write_spill(path, slot, "bench"),
        "plain_write": plain_write,
        "read": lambda: read_spill(path, slot),
        "plain_read": plain_read,
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(7):  # interleaved: the machine's load moves between rounds, not within one
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    best["restore"] /= 2  # a round trip is two restores
    plain_copy, restore, save = best["plain_copy"], best["restore"], best["save"]
    read, write, plain_r, plain_w = best["read"], best["write"], best["plain_read"], best["plain_write"]
    print(
        f"tier bandwidth, {nbytes / 1e6:.0f} MB, best of 7 interleaved rounds (goal >= 50 % of the plain copy):"
    )
    for name, t, ref in [
        ("host -> live (switch)", restore, plain_copy),
        ("live -> host (save)  ", save, plain_copy),
        ("disk -> host (mmap)  ", read, plain_r),
        ("host -> disk (spill) ", write, plain_w),
    ]:
        print(
            f"  {name}: {nbytes / t / 1e9:6.2f} GB/s vs plain {nbytes / ref / 1e9:6.2f} GB/s -> {ref / t:.0%}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--mb", type=int, default=128, help="MB of weights per copy (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per arm (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="rows per forward pass (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # compute on one core; the prefetch thread gets the other
    with tempfile.TemporaryDirectory(prefix="bench-teachers-") as tmp:
        prefetch_bench(args, Path(tmp))
        tier_bench(args, Path(tmp))


if __name__ == "__main__":
    main()
