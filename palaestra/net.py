"""Loopback networking helpers shared by the launchers, tests, benchmarks and demos.

`free_port()` asks the kernel for an unused 127.0.0.1 port, `wait_http_ok()` polls a URL until it
answers 2xx, and `ServerProcess` runs a local HTTP server as a subprocess (output to a log file,
start-up wait, terminate-then-kill, restart on the same port after a crash, a fresh port when the
one picked was taken before the server bound it) so that the router and SGLang launchers share one
lifecycle.
`is_this_host()` and `address_towards()` tell the weight sync which engines share this host and
which local address remote engines reach.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from palaestra import lifeline

__all__ = [
    "ServerProcess",
    "ServerStartError",
    "address_towards",
    "free_port",
    "is_this_host",
    "wait_http_ok",
]

LOOPBACK = "127.0.0.1"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What uvicorn, Rust servers (the router) and C servers print when bind() fails with EADDRINUSE.
_ADDRESS_IN_USE = re.compile(r"address already in use|errno 98\b|os error 98\b", re.IGNORECASE)
PORT_ATTEMPTS = 3  # starts of a server whose picked port another process took first


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on `host` right now.

    The socket is closed before returning, so another process may still take the port before the
    caller binds it; callers that can bind a socket themselves should pass that socket instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_http_ok(
    url: str,
    timeout: float,
    *,
    predicate: Callable[[httpx.Response], bool] | None = None,
    interval: float = 0.05,
    abort: Callable[[], None] | None = None,
) -> httpx.Response:
    """Poll `GET url` until it answers 2xx (and `predicate(response)` holds); return that response.

    `abort`, if given, is called before every attempt and may raise to stop waiting early (e.g.
    because the server process died). Raises `TimeoutError` naming the last status or error.
    """
    deadline = time.monotonic() + timeout
    last = "no attempt"
    with httpx.Client(timeout=max(1.0, interval * 10), trust_env=False) as client:
        while True:
            if abort is not None:
                abort()
            try:
                response = client.get(url)
                if response.is_success and (predicate is None or predicate(response)):
                    return response
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{url} did not become ready within {timeout:g} s (last: {last})")
            time.sleep(interval)


class ServerStartError(RuntimeError):
    """A server subprocess exited or timed out during start-up; the message carries its log tail."""


class ServerProcess:
    """A local HTTP server run as a subprocess.

    Its stdout and stderr go to one log file (never a pipe: a chatty server would block once the
    pipe buffer fills). `start()` waits until `GET {url}{ready_path}` answers 2xx and `ready`
    accepts the answer; if the process dies or the wait times out it raises `ServerStartError`
    with the log tail. `stop()` sends SIGTERM, then SIGKILL after `stop_timeout` seconds.
    Use it as a context manager.

    `free_ports` names the argv flags (e.g. `"--port"`) whose values the caller picked with
    `free_port()`. Between that pick and the server's bind another process may take the port (the
    kernel hands the same range to outgoing connections); when the server then exits at start-up
    saying its address is in use, those ports are picked again (the URL follows the one it names)
    and the start is tried again, `PORT_ATTEMPTS` times in all. `restart()` never moves a port.
    """

    def __init__(
        self,
        argv: Sequence[str],
        url: str,
        *,
        name: str = "server",
        ready_path: str = "/health",
        ready: Callable[[httpx.Response], bool] | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        log_noise: str | None = None,
        free_ports: Sequence[str] = (),
    ) -> None:
        self.argv = list(argv)
        missing = [flag for flag in free_ports if flag not in self.argv[:-1]]
        if missing:
            raise ValueError(f"free_ports {missing} are not flags with a value in the argv")
        self.free_ports = tuple(free_ports)
        self.url = url.rstrip("/")
        self.name = name
        self.ready_path = ready_path
        self.ready = ready
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.env = dict(env) if env is not None else None
        # Lines matching this (e.g. the server logging our own readiness polls) are left out of tails.
        self.log_noise = re.compile(log_noise) if log_noise else None
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def poll(self) -> int | None:
        """The exit code, or None while running (or before start)."""
        return self._proc.poll() if self._proc is not None else None

    def port_of(self, flag: str) -> int:
        """The port the argv passes with `flag` (e.g. `"--port"`)."""
        return int(self.argv[self.argv.index(flag) + 1])

    def start(self, *, append: bool = False) -> ServerProcess:
        """Starts the process and waits until it is ready; `append` keeps the log written so far."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"palaestra-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        attempts = PORT_ATTEMPTS if self.free_ports and not append else 1
        for attempt in range(1, attempts + 1):
            offset = self.log_path.stat().st_size if (append or attempt > 1) else 0
            try:
                return self._start_once(append=append or attempt > 1)
            except ServerStartError:
                if attempt == attempts or not self._lost_a_port(offset):
                    raise
                self._proc = None
                self._repick_ports()
        raise AssertionError("unreachable")

    def _lost_a_port(self, offset: int) -> bool:
        """Whether the attempt whose output starts at `offset` exited because a port was taken."""
        with open(self.log_path, "rb") as log:  # type: ignore[arg-type]
            log.seek(offset)
            return _ADDRESS_IN_USE.search(log.read().decode("utf-8", "replace")) is not None

    def _repick_ports(self) -> None:
        url = urlsplit(self.url)
        host = url.hostname or LOOPBACK
        moved = []
        for flag in self.free_ports:
            i = self.argv.index(flag) + 1
            old, self.argv[i] = self.argv[i], str(free_port(host))
            moved.append(f"{flag} {old} -> {self.argv[i]}")
            if url.port == int(old):
                name = f"[{host}]" if ":" in host else host
                self.url = url._replace(netloc=f"{name}:{self.argv[i]}").geturl()
        with open(self.log_path, "ab") as log:  # type: ignore[arg-type]
            log.write(f"\n--- {self.name}: a port was taken; again with {', '.join(moved)} ---\n".encode())

    def _start_once(self, *, append: bool) -> ServerProcess:
        assert self.log_path is not None
        env = lifeline.child_env({**os.environ, **(self.env or {})})
        began = time.monotonic()
        with open(self.log_path, "ab" if append else "wb") as log:
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        try:
            wait_http_ok(
                self.url + self.ready_path,
                self.startup_timeout,
                predicate=self.ready,
                abort=self._raise_if_exited,
            )
        except TimeoutError as exc:
            self._terminate()
            raise ServerStartError(f"{self.name} did not start: {exc}\n{self._tail_block()}") from None
        except ServerStartError:
            self._terminate()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def restart(self, extra_args: Sequence[str] = ()) -> ServerProcess:
        """The same command again (with `extra_args` after it, for this start only), on the same
        URL (so clients' addresses stay valid), once the old process is gone (stopped first if it
        still runs); its log continues in the same file, after a marker line, so the crash's
        output is kept."""
        self._terminate()
        self._proc = None
        if self.log_path is not None:
            with open(self.log_path, "ab") as log:
                log.write(f"\n--- {self.name} restarted at {time.strftime('%H:%M:%S')} ---\n".encode())
        argv, self.argv = self.argv, [*self.argv, *extra_args]
        try:
            return self.start(append=True)
        finally:
            self.argv = argv

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process exits (raises subprocess.TimeoutExpired after `timeout`)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc.wait(timeout)

    def stop(self) -> int | None:
        """Terminate (then kill) the process; return its exit code. Safe to call twice."""
        code = self._terminate()
        if self._own_log and self.log_path is not None:
            # A clean stop leaves nothing worth keeping; a failed start keeps its log (see message).
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        return code

    def log_tail(self, max_chars: int = 4000) -> str:
        """The last `max_chars` characters of the process output, ANSI colours removed."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 64 * max_chars))
            text = _ANSI.sub("", log.read().decode("utf-8", "replace"))
        if self.log_noise is not None:
            text = "".join(line for line in text.splitlines(True) if not self.log_noise.search(line))
        return text[-max_chars:]

    def _raise_if_exited(self) -> None:
        code = self.poll()
        if code is not None:
            raise ServerStartError(
                f"{self.name} exited with code {code} during start-up\n{self._tail_block()}"
            )

    def _tail_block(self) -> str:
        return f"--- last output of {self.name} ({self.log_path}) ---\n{self.log_tail()}"

    def _terminate(self) -> int | None:
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def __enter__(self) -> ServerProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def is_this_host(url: str) -> bool:
    """Whether `url`'s host is an address of this machine (one a socket here can bind)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def address_towards(urls: Sequence[str]) -> str:
    """This host's address as the engines reach it: loopback when they all are, else the source
    address of the route to the first non-loopback engine (no packet is sent)."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    remote = [h for h in hosts if h not in ("127.0.0.1", "localhost", "::1")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return s.getsockname()[0]
