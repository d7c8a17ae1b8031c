"""Math answers: extract the model's final answer and decide equivalence with math-verify.

    >>> verify_math(r"... so the total is \\boxed{\\frac{1}{2}}", "0.5")
    MathResult(reward=1.0, correct=True, parsed='\\\\frac{1}{2}', expected='0.5', reason='equivalent')

Extraction (`extract_answer`), in this order:

1. the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``); nested braces are fine, an unclosed one is
   ignored, and if the last one is empty there is no answer (we do not fall back to a number from the
   reasoning when the model clearly meant to box something);
2. otherwise whichever comes last of ``#### X`` and ``the answer is X`` / ``answer: X`` (X runs to the
   end of the line or sentence);
3. otherwise the last number in the text (``-1,234.5``, ``3/4``, ``50%``).

With ``require_boxed=True`` only step 1 counts.

Equivalence decisions (both sides go through the same `normalize_answer`, then math-verify):

- fractions, decimals and LaTeX agree by value: ``1/2`` = ``0.5`` = ``\\frac{1}{2}`` = ``\\dfrac12``.
  Decimals are compared after rounding to 6 places (math-verify's default), so ``0.333333`` matches
  ``1/3`` but ``0.33`` does not.
- thousands separators are removed when they are well formed: ``1,000`` = ``1000`` =
  ``1{,}000``; ``1,5`` is not a number with a separator (it reads as the set {1, 5}) and matches
  neither 15 nor 1.5.
- percentages: a trailing ``%`` makes an answer equal to BOTH its face value and its value / 100, in
  either direction: ``50%`` = ``0.5`` and ``50%`` = ``50``. A bare number is never rescaled:
  ``0.5`` != ``50``. Reason: GSM8K-style gold answers are bare numbers ("#### 50" for "what percent
  ...?") and a model that writes "50%" is right; a model that writes 0.5 for "50%" names the same
  quantity. This is math-verify's own rule; we keep it and test it.
- signs matter (``-3`` != ``3``); currency signs, ``\\text{...}`` units and plain unit words after a
  number are dropped (``$12``, ``12 dollars``, ``12\\text{ cm}`` all = ``12``); ``x = 5`` = ``5``.
- answers whose normalised text is identical are equal without calling math-verify (this also makes
  non-numeric answers such as ``Tuesday`` comparable).

Timeout: math-verify's own timeout uses ``signal.alarm``, which only works on the main thread and in
whole seconds, and sympy can hang inside C code (``10^{10^{10}}`` is a big-integer power) where no
signal is delivered. So comparisons run in a small pool of worker processes (plain ``python -c``
subprocesses talking JSON lines over pipes; each imports math-verify once and has its address space
capped). The caller waits ``timeout_s`` for the answer; past that the worker is killed, a
replacement is started at once, and the result says ``reason="timeout"``. This works from any
thread and from asyncio (`averify_math`). Cost, measured on the 2-core dev machine: for distinct
answers a call through a worker took 1.0x the time of calling math-verify in-process (~2 ms
either way; the pipe round trip is lost in the noise); a timeout costs one worker restart, ~0.3 s
before the next call can use that slot. Time spent waiting for a free worker when all are busy
does not count against ``timeout_s``.

`verify_math` uses a shared pool created on first use (no arguments, so nothing about it depends on
who called first); create a `MathVerifier` yourself for a different pool size or memory cap.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MathResult",
    "MathVerifier",
    "MathVerifierError",
    "averify_math",
    "boxed_spans",
    "extract_answer",
    "normalize_answer",
    "verify_math",
]

Reason = Literal[
    "equivalent",
    "not equivalent",
    "no answer found",
    "unparseable",
    "expected unparseable",
    "timeout",
    "error",
]

# Answers longer than this are not handed to the parser: no real final answer is this long, and
# the LaTeX parser's cost grows badly with nesting.
MAX_ANSWER_CHARS = 1000


@dataclass(frozen=True)
class MathResult:
    """The outcome of one verification. ``reward`` is 1.0 when ``correct`` and 0.0 otherwise."""

    reward: float
    correct: bool
    parsed: str | None
    """The answer extracted from the completion (before normalisation); None if none was found."""
    expected: str
    reason: Reason
    """``equivalent``, ``not equivalent``, ``no answer found``, ``unparseable`` (the model's answer
    could not be read as math), ``expected unparseable`` (the gold answer could not: a task bug),
    ``timeout``, or ``error`` (the comparison raised, e.g. ran out of memory)."""


class MathVerifierError(RuntimeError):
    """The verifier itself failed (a worker could not start); never raised for bad model output."""


# --------------------------------------------------------------------------------------- extraction

_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed_spans(text: str) -> list[tuple[int, int, int]]:
    """Every balanced ``\\boxed{...}``/``\\fbox{...}`` as ``(start, content_start, end)``, in order of
    their closing brace. ``text[content_start:end - 1]`` is the content. One linear pass, so a
    completion full of unclosed ``\\boxed{`` costs O(n), not O(n^2)."""
    opens = {m.end() - 1: m.start() for m in _BOXED_OPEN.finditer(text)}
    stack: list[int] = []  # positions of open braces
    spans: list[tuple[int, int, int]] = []
    for i, ch in enumerate(text):
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):
            stack.append(i)
        elif ch == "}" and stack and (i == 0 or text[i - 1] != "\\"):
            open_pos = stack.pop()
            if open_pos in opens:
                spans.append((opens[open_pos], open_pos + 1, i + 1))
    return spans


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced box (``""`` when it is empty), or None when there is none."""
    spans = boxed_spans(text)
    if not spans:
        return None
    _, content_start, end = spans[-1]
    return text[content_start : end - 1]


_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"\banswer[ \t]*(?:is|:|=)[ \t:]*([^\n]*)", re.IGNORECASE)
# A number as a model writes it: sign, thousands separators, decimals, a simple fraction, a percent.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[ \t]*/[ \t]*\d+)?(?:[ \t]*\\?%)?")
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _tidy(answer: str) -> str:
    """Cut a captured answer at the end of its sentence and strip markdown / punctuation."""
    answer = _SENTENCE_END.split(answer, maxsplit=1)[0]
    return answer.strip().strip("*").strip().rstrip(".,;:!").strip()


def extract_answer(text: str, *, require_boxed: bool = False) -> str | None:
    """The model's final answer as written (see the module docstring for the rules), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        boxed = boxed.strip()
        return boxed or None
    if require_boxed:
        return None
    candidates = [m for pattern in (_HASHES, _ANSWER_IS) for m in pattern.finditer(text)]
    for m in sorted(candidates, key=lambda m: m.start(), reverse=True):
        answer = _tidy(m.group(1))
        if answer:
            return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


# ------------------------------------------------------------------------------------ normalisation

_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?!\d|,\d)")
_DIGIT_SPACE = re.compile(r"(?<=\d)(?:\\,|\\!|\\ |\{,\})(?=\d)")
_PERCENT_WORD = re.compile(r"(?<=\d)\s*(?:percent|per cent)\b", re.IGNORECASE)
_SCIENTIFIC = re.compile(r"^(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")
_NUM = r"-?\d+(?:\.\d+)?(?:/\d+)?(?:\s*\\?%)?"
_TEXT_UNIT = re.compile(rf"^({_NUM})\s*(?:\\(?:text|mbox|mathrm)\{{[^{{}}]*\}}\s*)+$")
_WORD_UNIT = re.compile(rf"^({_NUM})\s+([A-Za-z][A-Za-z.\s/]*)$")
# Words after a number that are math, not units.
_MATH_WORDS = {"pi", "sqrt", "log", "ln", "sin", "cos", "tan", "exp", "inf", "infinity", "i"}
_UNICODE = {"−": "-", "×": r"\times ", "÷": r"\div ", "·": r"\cdot ", "°": "", "％": "%"}


def normalize_answer(answer: str) -> str:
    """Canonical text for an answer: math delimiters, currency, units and thousands separators
    removed, ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``1e3`` -> ``1\\times10^{3}``."""
    s = answer.strip()
    inner = _last_boxed(s)
    if inner is not None and boxed_spans(s)[-1][0] == 0 and s.endswith("}"):
        s = inner.strip()  # a gold answer given as \boxed{...}
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    for left, right in ((r"\(", r"\)"), (r"\[", r"\]"), ("$$", "$$"), ("$", "$")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    s = s.replace(r"\$", "").replace("$", "")  # what is left is currency
    s = s.strip("*").strip().rstrip(".,;:!").strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _PERCENT_WORD.sub("%", s)
    s = _DIGIT_SPACE.sub(lambda m: "," if m.group(0) == "{,}" else "", s)
    s = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), s)
    if m := _TEXT_UNIT.match(s):
        s = m.group(1)
    elif (m := _WORD_UNIT.match(s)) and not (set(m.group(2).lower().split()) & _MATH_WORDS):
        s = m.group(1)
    if m := _SCIENTIFIC.match(s):
        s = rf"{m.group(1)}\times10^{{{m.group(2)}}}"
    return " ".join(s.split())


# ------------------------------------------------------------------------------------ worker side

# The worker is a fresh interpreter started with `python -c`, not a multiprocessing child: spawn and
# forkserver re-import the caller's __main__, which re-runs any environment script that lacks an
# `if __name__ == "__main__":` guard. A plain subprocess imports nothing of the caller's.
_WORKER_COMMAND = "from palaestra.verifiers.math import _worker_main; _worker_main()"


def _worker_main() -> None:
    """Worker process: import math-verify once, then answer one JSON request per stdin line with one
    JSON reason per stdout line, until stdin closes (which is also how it dies with its parent).

    Runs single-threaded with no timeout of its own; the parent kills it when it takes too long."""
    memory_mb = int(os.environ.get("PALAESTRA_MATH_WORKER_MEMORY_MB", "0"))
    if memory_mb > 0:
        try:
            import resource

            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass  # no RLIMIT_AS here; the parent's timeout still applies
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout = sys.stderr
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it warns that we passed no timeout
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from sympy import Basic, MatrixBase

    def parse_answer(text: str) -> list:
        parsed = parse(f"${text}$", [LatexExtractionConfig()], parsing_timeout=None)
        if not any(isinstance(p, Basic | MatrixBase) for p in parsed):
            parsed = parse(text, [ExprExtractionConfig()], parsing_timeout=None) or parsed
        return parsed

    def compare(pred: str, gold: str) -> str:
        gold_parsed = parse_answer(gold)
        if not any(isinstance(g, Basic | MatrixBase) for g in gold_parsed):
            return "expected unparseable"
        pred_parsed = parse_answer(pred)
        if not pred_parsed:
            return "unparseable"
        if verify(gold_parsed, pred_parsed, timeout_seconds=None):
            return "equivalent"
        # math-verify keeps the text beside what it read; with no expression at all, the answer
        # could not be read as math (``@@ ??``), which is not the same as a wrong number
        return (
            "not equivalent" if any(isinstance(p, Basic | MatrixBase) for p in pred_parsed) else "unparseable"
        )

    protocol.write('"ready"\n')
    protocol.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reason = compare(request["pred"], request["gold"])
        except Exception:  # MemoryError (the address-space cap), RecursionError, sympy's own errors
            reason = "error"
        protocol.write(json.dumps(reason) + "\n")
        protocol.flush()


# ------------------------------------------------------------------------------------ parent side


class _Worker:
    """One worker subprocess and the line protocol to it."""

    def __init__(self, memory_mb: int) -> None:
        env = {**os.environ, "PALAESTRA_MATH_WORKER_MEMORY_MB": str(memory_mb)}
        self.process = subprocess.Popen(
            # -P: the caller's working directory is not put on sys.path (nothing there can shadow
            # sympy or palaestra); PYTHONPATH and the installed packages still are.
            [sys.executable, "-P", "-c", _WORKER_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            # Its own session: a Ctrl-C meant for the caller does not spray tracebacks from here.
            # When the caller dies the worker's stdin closes and it exits after its current
            # comparison (bounded by its memory cap if that comparison is a runaway).
            start_new_session=True,
        )
        self._buffer = b""
        self.ready = False

    def read_line(self, timeout_s: float) -> str | None:
        """The next line from the worker, or None if none arrives within ``timeout_s``.
        Raises EOFError if the worker has exited."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("math-verify worker exited")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8")

    def send(self, pred: str, gold: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"pred": pred, "gold": gold}).encode("utf-8") + b"\n")
        self.process.stdin.flush()

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        try:
            if self.read_line(timeout_s) == '"ready"':
                self.ready = True
                return
            problem = f"did not start within {timeout_s:.0f} s"
        except (EOFError, OSError):
            problem = (
                f"exited during start-up (code {self.process.wait()}); try `python -c 'import math_verify'`"
            )
        self.kill()
        raise MathVerifierError(f"math-verify worker {problem}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class MathVerifier:
    """A pool of math-verify worker processes. Thread-safe; use from any thread or via `averify`.

    ``max_workers`` bounds concurrent comparisons (callers beyond it wait for a free worker);
    ``memory_mb`` caps each worker's address space (0 = no cap); ``startup_timeout_s`` bounds how
    long a new worker may take to import math-verify before `MathVerifierError` is raised."""

    def __init__(
        self, max_workers: int = 2, *, memory_mb: int = 2048, startup_timeout_s: float = 120.0
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._memory_mb = memory_mb
        self._startup_timeout_s = startup_timeout_s
        self._max_workers = max_workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._closed = False

    def _acquire(self) -> _Worker:
        while True:
            with self._lock:
                if self._closed:
                    raise MathVerifierError("MathVerifier is closed")
                try:
                    worker: _Worker | None = self._idle.get_nowait()
                except queue.Empty:
                    worker = None
                    if len(self._workers) < self._max_workers:
                        worker = _Worker(self._memory_mb)
                        self._workers.add(worker)
            if worker is None:
                try:
                    # Wakes as soon as a worker is put back; the timeout only re-checks whether a
                    # discarded worker left room to start a new one.
                    worker = self._idle.get(timeout=1.0)
                except queue.Empty:
                    continue
            if worker.process.poll() is not None:  # died while idle
                self._discard(worker, replace=False)
                continue
            try:
                worker.wait_ready(self._startup_timeout_s)
            except MathVerifierError:
                self._discard(worker, replace=False)
                raise
            return worker

    def _discard(self, worker: _Worker, *, replace: bool) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            if replace and not self._closed:
                # Started now, so its import overlaps with whatever the caller does next.
                fresh = _Worker(self._memory_mb)
                self._workers.add(fresh)
                self._idle.put(fresh)

    def _compare(self, pred: str, gold: str, timeout_s: float) -> Reason:
        worker = self._acquire()
        try:
            worker.send(pred, gold)
            line = worker.read_line(timeout_s)
        except (EOFError, OSError):  # the worker died mid-comparison (e.g. killed by the OS)
            self._discard(worker, replace=True)
            return "error"
        if line is None:
            self._discard(worker, replace=True)
            return "timeout"
        self._idle.put(worker)
        return json.loads(line)

    def verify(
        self, completion: str, expected: str, *, timeout_s: float = 5.0, require_boxed: bool = False
    ) -> MathResult:
        """Extract the answer from ``completion`` and compare it with ``expected``."""
        parsed = extract_answer(completion, require_boxed=require_boxed)
        if parsed is None:
            return _result(False, None, expected, "no answer found")
        pred, gold = normalize_answer(parsed), normalize_answer(expected)
        if not gold or len(gold) > MAX_ANSWER_CHARS:
            return _result(False, parsed, expected, "expected unparseable")
        if not pred:
            return _result(False, parsed, expected, "no answer found")
        if pred == gold:
            return _result(True, parsed, expected, "equivalent")
        if len(pred) > MAX_ANSWER_CHARS:
            return _result(False, parsed, expected, "unparseable")
        reason = self._compare(pred, gold, timeout_s)
        return _result(reason == "equivalent", parsed, expected, reason)

    async def averify(
        self, completion: str, expected: str, *, timeout_s: float = 5.0, require_boxed: bool = False
    ) -> MathResult:
        """`verify` without blocking the event loop (it waits on a worker in a thread)."""
        return await asyncio.to_thread(
            self.verify, completion, expected, timeout_s=timeout_s, require_boxed=require_boxed
        )

    def close(self) -> None:
        """Kill the workers. Idempotent; calls after this raise `MathVerifierError`."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, set()
        for worker in workers:
            worker.kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result(correct: bool, parsed: str | None, expected: str, reason: Reason) -> MathResult:
    return MathResult(
        reward=1.0 if correct else 0.0, correct=correct, parsed=parsed, expected=expected, reason=reason
    )


_default: tuple[int, MathVerifier] | None = None  # (pid that made it, pool); see `_default_verifier`
_default_lock = threading.Lock()


def _default_verifier() -> MathVerifier:
    """The shared pool, made on first use; a forked child gets its own rather than its parent's."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            verifier = MathVerifier(max_workers=max(1, min(4, os.cpu_count() or 1)))
            atexit.register(verifier.close)
            _default = (os.getpid(), verifier)
        return _default[1]


def verify_math(
    completion: str, expected: str, *, timeout_s: float = 5.0, require_boxed: bool = False
) -> MathResult:
    """Score ``completion`` against ``expected`` with the shared `MathVerifier` (see module docstring)."""
    return _default_verifier().verify(completion, expected, timeout_s=timeout_s, require_boxed=require_boxed)


async def averify_math(
    completion: str, expected: str, *, timeout_s: float = 5.0, require_boxed: bool = False
) -> MathResult:
    """`verify_math` for async code: does not block the event loop."""
    return await _default_verifier().averify(
        completion, expected, timeout_s=timeout_s, require_boxed=require_boxed
    )
