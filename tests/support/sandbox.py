"""Sandbox backends for the tests, by name, and the fixtures that hand them out.

``SANDBOX_BACKENDS`` maps a name to a context manager that sets the backend up (e.g. starts an exec
server) and yields a zero-argument callable making a fresh ``Backend`` (call it inside the event
loop that will use it). The hostile suite and the pool tests run once per entry; a new backend
joins them with one decorated function here:

    @register_backend("docker")
    @contextlib.contextmanager
    def docker_backend():
        ...  # pytest.skip("why") when the engine is missing: the skip shows in the report
        yield lambda: DockerBackend(label=TEST_LABEL)

Convention the hostile suite relies on: a backend that bounds the memory of a sandbox's whole
process tree says "memory" in ``ExecResult.enforced`` (e.g. "cgroup v2 (memory, pids) + rlimits").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from palaestra.net import ServerProcess, free_port
from palaestra.sandbox import Backend

TEST_LABEL = "palaestra-test"
BackendMaker = Callable[[], Backend]
SANDBOX_BACKENDS: dict[str, Callable[[], contextlib.AbstractContextManager[BackendMaker]]] = {}


def register_backend(name: str):
    def add(factory):
        SANDBOX_BACKENDS[name] = factory
        return factory

    return add


@register_backend("local")
@contextlib.contextmanager
def local_backend() -> Iterator[BackendMaker]:
    from palaestra.sandbox.local import LocalBackend

    yield lambda: LocalBackend(label=TEST_LABEL)


@register_backend("local-root-userns")
@contextlib.contextmanager
def local_root_userns_backend() -> Iterator[BackendMaker]:
    """The local backend's fallback for hosts that refuse unprivileged user namespaces."""
    from palaestra.sandbox.local import LocalBackend

    if os.geteuid() != 0:
        pytest.skip("the root-userns mode of the local backend needs root")
    yield lambda: LocalBackend(label=TEST_LABEL, mode="root-userns")


@contextlib.contextmanager
def exec_server(api_key: str, *extra: str) -> Iterator[ServerProcess]:
    """`python -m palaestra.sandbox serve` (local backend) on a free loopback port."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "palaestra.sandbox",
        "serve",
        "--port",
        str(port),
        "--label",
        TEST_LABEL,
        *extra,
    ]
    env = {"PALAESTRA_SANDBOX_API_KEY": api_key}
    with ServerProcess(argv, f"http://127.0.0.1:{port}", name="sandbox-server", env=env) as server:
        yield server


@register_backend("remote")
@contextlib.contextmanager
def remote_backend() -> Iterator[BackendMaker]:
    from palaestra.sandbox.remote import RemoteBackend

    key = secrets.token_hex(16)
    with exec_server(key) as server:
        yield lambda: RemoteBackend(url=server.url, api_key=key, label=TEST_LABEL)


@register_backend("docker")
@contextlib.contextmanager
def docker_backend() -> Iterator[BackendMaker]:
    """Containers on the local docker engine (skips, saying why, where no engine answers)."""
    from palaestra.sandbox.docker import DockerBackend
    from tests.support.docker import require_engine

    require_engine()
    yield lambda: DockerBackend(label=TEST_LABEL)


@register_backend("compose")
@contextlib.contextmanager
def compose_backend() -> Iterator[BackendMaker]:
    """The docker-compose.yml sandbox fleet (exec-server replicas with no network, behind the
    loopback front), reached with the remote backend."""
    from palaestra.sandbox.remote import RemoteBackend
    from tests.support.docker import compose_fleet

    with compose_fleet(TEST_LABEL) as fleet:
        yield lambda: RemoteBackend(url=fleet.url, api_key=fleet.api_key, label=TEST_LABEL)


@dataclass
class NamedBackend:
    name: str
    make: BackendMaker


def backend_param(name: str):
    """A backend name as a fixture param, marked `docker` where the backend needs the docker engine."""
    return pytest.param(name, marks=pytest.mark.docker) if name in DOCKER_BACKENDS else name


DOCKER_BACKENDS = ("docker", "compose")


@pytest.fixture(scope="module", params=[backend_param(n) for n in sorted(SANDBOX_BACKENDS)])
def sandbox_backend(request) -> Iterator[NamedBackend]:
    """Each registered backend in turn (module scope: an exec server starts once per module)."""
    with SANDBOX_BACKENDS[request.param]() as make:
        yield NamedBackend(request.param, make)


@pytest.fixture(scope="module")
def loop_runner() -> Iterator[asyncio.Runner]:
    """One event loop for a whole module, so that sandboxes and pools outlive a single test."""
    with asyncio.Runner() as r:
        yield r


def marker() -> str:
    """A unique string to put into a command, to find its processes in /proc afterwards."""
    return f"palaestra-mark-{secrets.token_hex(6)}"


def processes_with(text: str) -> list[int]:
    """Pids of live processes on this host whose command line contains ``text``."""
    needle = text.encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def descendants(root: int | None = None) -> list[int]:
    """Pids of every live descendant of ``root`` (default: this process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [os.getpid() if root is None else root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def sandbox_memory_mb() -> dict[str, int]:
    """Memory this test run's sandboxes hold now, measured where other work on a shared host does
    not show up (MemAvailable moves by GBs with other people's jobs): the resident memory of this
    process's descendants (local sandboxes, the exec server and its sandboxes), where sandboxes
    get cgroups, what the cgroups of sandboxes they own are charged (processes and tmpfs files),
    and what this run's docker containers and compose replicas hold (their cgroups, via the engine)."""
    rss = 0
    ours = descendants()
    for pid in ours:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
        except OSError:
            pass
    from palaestra.sandbox.cgroups import CgroupHost

    host, _ = CgroupHost.detect()
    charged = 0
    owners = {str(pid) for pid in [os.getpid(), *ours]}  # not another test run's sandboxes
    if host is not None:
        for name in host.names():
            label, _, rest = name.partition(".")
            if label == TEST_LABEL and rest.partition("-")[0] in owners:
                charged += host.open(name).memory_bytes()
    from tests.support.docker import FLEET_PROJECT, containers_memory_mb, engine

    client = engine()
    containers = 0
    if client is not None:  # the docker backend's containers and the compose fleet's replicas
        containers += containers_memory_mb(client, TEST_LABEL, owner_pid=os.getpid())
        containers += containers_memory_mb(client, f"com.docker.compose.project={FLEET_PROJECT}")
    return {"rss": rss >> 10, "cgroups": charged >> 20, "containers": containers}


KILL = "palaestra-kill-me"
"""A command holding this text has its sandbox killed while it runs (`KillingBackend`)."""


class KillingBackend:
    """A real backend whose sandbox is SIGKILLed by its process group (a local sandbox's bwrap and
    everything under it, the exec server `agent.py` included) while an exec whose command or stdin
    holds `marker` runs in it; `killed` lists the process groups. Everything else is the backend's."""

    def __init__(self, backend: Backend, marker: str = KILL):
        self.backend, self.marker = backend, marker
        self.killed: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    async def create(self, *args, **kwargs):
        box = await self.backend.create(*args, **kwargs)
        real = box.exec

        async def exec(*a, **kw):
            if self.marker not in json.dumps([a, kw], default=str):
                return await real(*a, **kw)
            run = asyncio.ensure_future(real(*a, **kw))
            await asyncio.sleep(0.5)  # the command is running
            assert not run.done(), run.result()
            os.killpg(box.pid, signal.SIGKILL)
            self.killed.append(box.pid)
            return await run

        box.exec = exec
        return box
