"""The in-container half of the docker backend: PID 1 of every sandbox container, and the supervisor
the backend ``docker exec``s for each command, upload and download.

It runs inside the image with the image's own python (``python3 -I -S``, stdlib only) and never
imports palaestra. Through ``docker exec``, the host sends one JSON line on stdin, then the raw
payload (the command's stdin or an uploaded file's bytes); ``exec`` answers one JSON object on
stdout. With $PALAESTRA_RUNNER_SOCKET set, PID 1 itself connects to the host over that unix socket
and answers the same requests as frames (``serve``): no docker exec per command, ~1 ms instead of
~100 ms.

    python3 -I -S /opt/palaestra/runner.py init        # PID 1: serves the host's socket, or idles
    python3 -I -S /opt/palaestra/runner.py exec        # {"argv": [...], "timeout": 5, ...} + stdin
    python3 -I -S /opt/palaestra/runner.py put         # {"path": "a/b.py"} + file bytes
    python3 -I -S /opt/palaestra/runner.py get         # {"path": "a/b.py"} -> file bytes on stdout
    python3 -I -S /opt/palaestra/runner.py reap        # kill every process but PID 1 and itself

Why a supervisor in the container rather than timing and killing from the host: docker has no
"kill this exec" call, and only a process inside the container's PID namespace can see and kill a
``setsid`` child that outlived its parent. Every exec ends with ``kill(-1, SIGKILL)``, which the
kernel limits to this container's PID namespace and never delivers to its PID 1, so nothing a
command started survives it. Execs in one sandbox are serialized by the backend for that reason.
"""

import ctypes
import json
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import sys
import time

WORKDIR = "/work"
SECCOMP_FILTER = "/opt/palaestra/seccomp.bpf"
"""The commands' seccomp deny-list, compiled on the host at image build (sandbox/seccomp.py): new
namespaces, mount, keyrings, bpf, perf, userfaultfd, io_uring, ptrace... answer EPERM on top of
docker's own profile."""
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_DUMPABLE = 38, 22, 2, 4


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def init() -> None:
    """PID 1: reap every orphan as soon as it exits (zombies count against pids.max)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        signal.sigtimedwait({signal.SIGCHLD}, 60)


def oom_kills() -> int:
    """The memory cgroup's OOM-kill counter (cgroup v2 memory.events, or v1 memory.oom_control)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return -1


def reap() -> int:
    """Kill every process in the container except PID 1 and this one; returns how many rounds it
    took. Loops because a fork bomb can fork between the kernel's walk and our check."""
    me = os.getpid()
    for rounds in range(1, 200):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        alive = []
        for pid in others:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in ("Z", "X"):
                alive.append(pid)
        if not alive:
            return rounds
        time.sleep(0.005)
    return -1


def _child_setup(spec: dict) -> None:
    """Runs in the child between fork and exec: its own session, rlimits, first in line for the
    OOM killer."""
    os.setsid()
    with open(SECCOMP_FILTER, "rb") as f:  # before RLIMIT_NOFILE can get in the way
        program = ctypes.create_string_buffer(f.read())
    # What the runner's python changed and exec keeps: a blocked signal mask, ignored SIGXFSZ.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    cpu = int(spec["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    fsize = int(spec["file_size_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    nofile = int(spec["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Last, so that nothing above needs a refused call; exec and all the command starts inherit it.
    fprog = SockFprog((len(program) - 1) // 8, ctypes.addressof(program))
    libc = ctypes.CDLL(None, use_errno=True)
    for args in (
        (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
        (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
    ):
        if libc.prctl(*args) != 0:
            raise OSError(ctypes.get_errno(), f"prctl{args[:1]}: {os.strerror(ctypes.get_errno())}")


class _Output:
    """What an exec's stdout and stderr produced: the first `limit` bytes of each, and how many came."""

    def __init__(self, out_r: int, err_r: int, limit: int) -> None:
        self.limit = limit
        self.kept = {out_r: bytearray(), err_r: bytearray()}
        self.seen = {out_r: 0, err_r: 0}

    def take(self, fd: int, chunk: bytes) -> int:
        """Keeps what fits of `chunk`; returns how many bytes `fd` has produced so far."""
        room = self.limit - len(self.kept[fd])
        if room > 0:
            self.kept[fd] += chunk[:room]
        self.seen[fd] += len(chunk)
        return self.seen[fd]


def _spawn(spec: dict) -> tuple[int, int, int, int, bytes]:
    """Forks and execs the command with its stdin, stdout and stderr on pipes: (pid, stdin's write
    end, stdout's and stderr's read ends, the start error: what failed before exec, or b"")."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # Closed by a successful exec; carries the error if exec fails (the classic self-pipe trick).
    fail_r, fail_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w, fail_r, fail_w):
            os.close(fd)
        raise
    if pid == 0:
        try:
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, fail_r):
                os.close(fd)
            _child_setup(spec)
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as exc:
            os.write(fail_w, f"{type(exc).__name__}: {exc}".encode())
        os._exit(127)
    for fd in (in_r, out_w, err_w, fail_w):
        os.close(fd)
    start_error = b""
    while chunk := os.read(fail_r, 4096):
        start_error += chunk
    os.close(fail_r)
    return pid, in_w, out_r, err_r, start_error


def _pump(pid: int, in_w: int, output: _Output, stdin_data: bytes, deadline: float, kill_at: int):
    """Feeds stdin and reads stdout/stderr until both close, the deadline passes or the output
    passes `kill_at` bytes; then waits for the command. Returns (why it was killed or "", the
    command's wait status, its rusage)."""
    pending = memoryview(stdin_data)
    sel = selectors.DefaultSelector()
    for fd in output.kept:
        sel.register(fd, selectors.EVENT_READ)
    # A pidfd turns readable when the child exits, so a background process still holding the
    # pipes open cannot keep us waiting (Linux >= 5.3; else we poll every 50 ms).
    try:
        child_fd = os.pidfd_open(pid)
        sel.register(child_fd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        child_fd = -1
    # Every descriptor this exec opened is closed by its end: PID 1 serves many execs.
    owned = {fd for fd in (in_w, *output.kept, child_fd) if fd >= 0}
    if pending:
        os.set_blocking(in_w, False)
        sel.register(in_w, selectors.EVENT_WRITE)
    else:
        os.close(in_w)
        owned.discard(in_w)
    reason = ""
    status_wait = None
    while set(sel.get_map()) - {child_fd}:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for key, _ in sel.select(min(left, 0.05 if child_fd < 0 else 5.0)):
            fd = key.fd
            if fd == child_fd:
                sel.unregister(child_fd)
                os.close(child_fd)
                owned.discard(child_fd)
                continue
            if fd == in_w:
                try:
                    pending = pending[os.write(in_w, pending[: 1 << 16]) :]
                except OSError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(in_w)
                    os.close(in_w)
                    owned.discard(in_w)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                sel.unregister(fd)
                continue
            if output.take(fd, chunk) > kill_at:
                reason = "output_limit"
        if reason:
            break
        if status_wait is None:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                # The command is over; whatever it left running (and holding our pipes) dies now,
                # so the reads below reach EOF.
                status_wait = (status, usage)
                reap()
    if status_wait is None:
        if reason:
            os.killpg(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        status_wait = (status, usage)
    reap()
    # Everything is dead now: what is left in the pipes is read to EOF.
    for fd in list(sel.get_map()):
        if fd in (child_fd, in_w):
            continue
        while chunk := os.read(fd, 1 << 16):
            output.take(fd, chunk)
    sel.close()
    for fd in owned:
        os.close(fd)
    return reason, *status_wait


def run(spec: dict, stdin_data: bytes) -> dict:
    """One command: started, fed, read and waited for under the spec's limits; the raw observations."""
    oom_before = oom_kills()
    start = time.monotonic()
    try:
        pid, in_w, out_r, err_r, start_error = _spawn(spec)
    except OSError as exc:
        return {"exit_code": None, "start_error": f"fork failed: {exc}"}
    output = _Output(out_r, err_r, int(spec["output_bytes"]))
    kill_at = output.limit * int(spec["output_kill_factor"])
    reason, status, usage = _pump(pid, in_w, output, stdin_data, start + float(spec["timeout"]), kill_at)
    duration = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    cpu_used = usage.ru_utime + usage.ru_stime
    oom_after = oom_kills()
    killed = reason or None
    if (
        not killed
        and code in killed_codes(signal.SIGXCPU, signal.SIGKILL)
        and cpu_used >= spec["cpu_s"] - 0.05
    ):
        killed = "cpu"
    # Raw observations; the host turns them into one status (sandbox/output.py's build_result).
    return {
        "exit_code": None if start_error else code,
        "start_error": start_error.decode(errors="replace") or None,
        "killed": killed,
        # Any OOM kill in the container during the exec is the command's doing (a sandbox runs
        # one exec at a time), also when it hit a child and the command itself exited normally.
        "oom_killed": oom_after > oom_before >= 0,
        "stdout": output.kept[out_r].decode("latin-1"),
        "stdout_total": output.seen[out_r],
        "stderr": output.kept[err_r].decode("latin-1"),
        "stderr_total": output.seen[err_r],
        "duration_s": round(duration, 6),
    }


def killed_codes(*signals: int) -> set[int]:
    """Exit codes of a command killed by one of ``signals``: -N directly, 128+N through a shell."""
    return {-s for s in signals} | {128 + s for s in signals}


def _resolve(path: str) -> str:
    full = os.path.realpath(os.path.join(WORKDIR, path))
    if full != WORKDIR and not full.startswith(WORKDIR + "/"):
        raise PermissionError(f"path {path!r} is outside the work directory")
    return full


def handle(mode: str, spec: dict, payload: bytes) -> tuple[int, bytes, bytes]:
    """One request: (exit code, stdout bytes, stderr bytes), the same whether it came through
    ``docker exec`` or the socket."""
    if mode == "exec":
        return 0, json.dumps(run(spec, payload)).encode(), b""
    if mode == "reap":
        return 0, json.dumps({"rounds": reap(), "oom_kills": oom_kills()}).encode(), b""
    if mode == "ping":
        return 0, b"", b""
    if mode not in ("put", "get"):
        return 2, b"", f"unknown mode {mode!r}".encode()
    try:
        full = _resolve(spec["path"])
        # Never follow a link the command planted, never block on a FIFO it made: open without
        # following, non-blocking, and insist on a regular file.
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        if mode == "put":
            os.makedirs(os.path.dirname(full), exist_ok=True)
            fd = os.open(full, flags | os.O_WRONLY | os.O_CREAT, 0o644)
        else:
            fd = os.open(full, flags | os.O_RDONLY)
        with os.fdopen(fd, "wb" if mode == "put" else "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PermissionError(f"{spec['path']!r} is not a regular file")
            os.set_blocking(fd, True)
            if mode == "put":
                f.truncate()
                f.write(payload)
                return 0, b"", b""
            return 0, f.read(), b""
    except FileNotFoundError as exc:
        return 3, b"", json.dumps({"error": "not_found", "detail": str(exc)}).encode()
    except OSError as exc:  # ELOOP (a planted link), ENXIO (a FIFO), EACCES...
        return 4, b"", json.dumps({"error": type(exc).__name__, "detail": str(exc)}).encode()


FRAME = struct.Struct(">IQ")  # JSON header length, payload length


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def serve(path: str) -> None:
    """PID 1 with a control channel: connect to the host's socket (bind-mounted read-only at
    ``path``; the host accepts only this process, checked by its pid) and answer requests one at a
    time until the host hangs up, then exit, which ends the container. Not dumpable, so commands
    (same uid) can neither ptrace it nor read its memory; as PID 1 it ignores their signals."""
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    for _ in range(200):
        try:
            sock.connect(path)
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("runner: cannot reach the host's socket")
    while True:
        try:
            head_len, payload_len = FRAME.unpack(_read_exact(sock, FRAME.size))
            request = json.loads(_read_exact(sock, head_len))
            payload = _read_exact(sock, payload_len)
        except (EOFError, OSError):
            return
        code, out, err = handle(request["mode"], request.get("spec") or {}, payload)
        head = json.dumps({"id": request.get("id"), "code": code, "err": err.decode("latin-1")}).encode()
        sock.sendall(FRAME.pack(len(head), len(out)) + head + out)
        try:  # orphans reparented to us (PID 1) between requests
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass


def main() -> int:
    mode = sys.argv[1]
    if mode == "init":
        if os.environ.get("PALAESTRA_RUNNER_SOCKET"):
            serve(os.environ["PALAESTRA_RUNNER_SOCKET"])
            return 0
        init()
    spec, payload = {}, b""
    if mode not in ("reap", "ping"):
        spec = json.loads(sys.stdin.buffer.readline())
        payload = sys.stdin.buffer.read()
    code, out, err = handle(mode, spec, payload)
    sys.stdout.buffer.write(out)
    sys.stderr.buffer.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main())
