"""Output capping and result classification shared by every backend.

A command's stdout and stderr are read while they stream into a ``CappedOutput``: it keeps the
first ``Limits.output_bytes`` bytes, counts (and drops) the rest, and reports when the count passes
``output_bytes * output_kill_factor`` so that the backend kills the command. A multi-GB flood
therefore costs ``output_bytes`` of memory, never the whole stream.

``build_result`` turns what a backend observed (exit code, its own kill reason, the cgroup's OOM
counter) into an ``ExecResult`` with one status, the same way for every backend.
"""

from __future__ import annotations

import re

from palaestra.sandbox.base import ExecResult, Limits

__all__ = ["CappedOutput", "KillReason", "build_result", "looks_like_memory_error"]

KillReason = str
"""Why a backend killed a command: "timeout" (wall clock), "cpu" (CPU time), "output_limit"."""

# What common runtimes print when an allocation fails under RLIMIT_AS (no cgroup OOM kill then).
_MEMORY_ERROR = re.compile(
    rb"MemoryError|std::bad_alloc|Cannot allocate memory|out of memory|memory allocation of \d+ bytes failed"
)


class CappedOutput:
    """The first ``keep`` bytes of a stream and the count of all of them."""

    def __init__(self, keep: int, kill_at: int) -> None:
        self.keep = keep
        self.kill_at = kill_at
        self.total = 0
        self._chunks: list[bytes] = []
        self._kept = 0

    @classmethod
    def for_limits(cls, limits: Limits) -> CappedOutput:
        return cls(limits.output_bytes, limits.output_bytes * limits.output_kill_factor)

    def feed(self, chunk: bytes) -> bool:
        """Add ``chunk``; True once the stream has passed the kill threshold."""
        self.total += len(chunk)
        room = self.keep - self._kept
        if room > 0:
            part = chunk[:room]
            self._chunks.append(part)
            self._kept += len(part)
        return self.total > self.kill_at

    @property
    def truncated(self) -> bool:
        return self.total > self.keep

    @property
    def over(self) -> bool:
        return self.total > self.kill_at

    def data(self) -> bytes:
        return b"".join(self._chunks)

    def text(self) -> str:
        # A cut can split a multi-byte character; "replace" keeps the rest readable.
        return self.data().decode("utf-8", "replace")


def looks_like_memory_error(stderr: bytes) -> bool:
    """True if the tail of ``stderr`` shows a failed allocation (Python, C++, libc, Rust)."""
    return bool(_MEMORY_ERROR.search(stderr[-4096:]))


def build_result(
    *,
    exit_code: int | None,
    stdout: CappedOutput,
    stderr: CappedOutput,
    duration_s: float,
    killed: KillReason | None = None,
    oom_killed: bool = False,
    start_error: str | None = None,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    address_space_mb: int | None = None,
) -> ExecResult:
    """One status from what happened. Precedence: could not start > output flood > an OOM kill
    in the sandbox during the exec (the memory limit was hit, even if the command then ran into
    its timeout) > our own kill (wall clock, CPU) > a failed allocation reported on stderr by a
    command that then failed (the address-space rlimit) > ok."""
    status, detail = "ok", ""
    if start_error is not None:
        status, detail = "error", start_error
    elif killed == "output_limit" or stdout.over or stderr.over:
        which = "stdout" if stdout.over else "stderr"
        status = "output_limit"
        detail = f"killed after {which} passed {max(stdout.kill_at, stderr.kill_at)} bytes"
    elif oom_killed:
        status, detail = (
            "memory",
            f"the OOM killer killed a process at the sandbox's memory limit ({memory_mb} MiB)",
        )
    elif killed == "timeout":
        status, detail = "timeout", f"killed after {timeout_s:g} s wall clock"
    elif killed == "cpu" or exit_code == -24:  # SIGXCPU: RLIMIT_CPU's soft limit
        status, detail = "timeout", "killed at the CPU-time limit"
    elif exit_code not in (0, None) and looks_like_memory_error(stderr.data()):
        status, detail = (
            "memory",
            f"an allocation failed at the {address_space_mb or memory_mb} MiB address-space limit",
        )
    elif exit_code == -25:  # SIGXFSZ: RLIMIT_FSIZE
        detail = "killed at the file-size limit"
    return ExecResult(
        status=status,
        exit_code=exit_code,
        stdout=stdout.text(),
        stderr=stderr.text(),
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
        duration_s=duration_s,
        detail=detail,
    )
