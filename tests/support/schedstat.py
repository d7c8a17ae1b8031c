"""How often the kernel ran one of this process's threads: what the tests of idle threads count
(wake-ups are counted, not timed, so they hold however fast the machine is)."""

from __future__ import annotations

from pathlib import Path


def thread_runs(native_id: int) -> int:
    """Times the kernel has run thread `native_id` of this process (schedstat's third field)."""
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[2])
