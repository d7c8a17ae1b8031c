"""The suite's markers, kept honest, and how `pytest -n` spreads the tests (tests/conftest.py loads it).

Markers (registered in pyproject.toml): `slow` (over ~30 s), and what a test starts: `ray` (a Ray
cluster, in this process or a child), `engine` (an inference engine process: the embedded engine's
`palaestra engine serve`, SGLang), `docker` (containers, compose), `browser` (a real browser).
`make test-fast` is the unit tier: none of slow, ray, docker, browser (engine tests stay: the
embedded `tiny` engine is a small real object).

Honest: while a test runs (its own body and every fixture it uses, whenever that fixture was set
up), what it starts is watched: child processes by their command line, a Ray initialised in this
process, a docker client. A test that started one of these without its marker fails, naming the
marker to add, so a new test cannot slip an engine into the unit tier.

Parallel (`make test` runs `pytest -n 2 --dist loadgroup`, `make test-fast` `-n 3`): the tests of one
module stay on one worker (its module fixtures start once), except that every `ray` test is on one
worker, one at a time (two train runs never share the 2 cores with each other), and so are the
`docker` ones (they build the same images, and measure their containers' memory), and the other
`slow` tests. Those groups are queued first, the longest first. Nothing here depends on where a
test file lives.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

import pytest

KINDS = ("ray", "engine", "docker", "browser")
"""What a test may start, each its own marker."""

GROUPS = ("ray", "docker", "slow")
"""The xdist groups whose tests run one at a time, in this order of queueing; a test of two (a slow
docker test) goes to the first."""

_started: set[str] = set()  # kinds started since the running test's (or fixture's) start


def kinds_of_command(argv: str | Iterable[str]) -> set[str]:
    """What a child process's command line starts."""
    words = str(argv).split() if isinstance(argv, (str, bytes)) else [str(a) for a in argv]
    joined = " ".join(words)
    kinds: set[str] = set()
    for i, word in enumerate(words[:-1]):
        if word == "engine" and words[i + 1] == "serve":  # palaestra engine serve
            kinds.add("engine")
        if word in ("palaestra", "palaestra.cli") and words[i + 1] == "train":
            if not {"--help", "-h", "--print-config"} & set(words):  # these start nothing
                kinds.add("ray")
    if "sglang.launch_server" in joined:
        kinds.add("engine")
    if "init_ray" in joined or "ray.init" in joined or words[:2] == ["ray", "start"]:
        kinds.add("ray")
    docker_cli = words[:1] and words[0].endswith(("docker", "docker-compose")) or "compose" in words[:2]
    if docker_cli and not {"config", "version", "--help"} & set(words):  # these need no engine
        kinds.add("docker")
    if "playwright" in joined or "chromium" in joined:
        kinds.add("browser")
    return kinds


def _watch_processes() -> None:
    init = subprocess.Popen.__init__

    def watched(self, args, *a, **kw):
        _started.update(kinds_of_command(args))
        return init(self, args, *a, **kw)

    subprocess.Popen.__init__ = watched  # every child, asyncio's and playwright's included


def _watch_docker() -> None:
    """Containers created and images built through the docker SDK (a client that only reads, e.g.
    to measure memory, starts nothing)."""
    try:
        from docker.api.client import APIClient
    except ImportError:  # no docker SDK: nothing can start containers through it
        return

    def watching(method):
        def watched(self, *a, **kw):
            _started.add("docker")
            return method(self, *a, **kw)

        return watched

    APIClient.create_container = watching(APIClient.create_container)
    APIClient.build = watching(APIClient.build)


def _ray_running() -> set[str]:
    ray = sys.modules.get("ray")
    return {"ray"} if ray is not None and getattr(ray, "is_initialized", lambda: False)() else set()


def pytest_configure(config: pytest.Config) -> None:
    _watch_processes()
    _watch_docker()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """What each fixture starts is remembered on it: every test using it started that too."""
    outer, ray_before = set(_started), _ray_running()
    _started.clear()
    yield
    fixturedef.palaestra_started = set(_started) | (_ray_running() - ray_before)
    _started.update(outer)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _started.clear()
    ray_before = _ray_running()
    yield
    item.palaestra_started = set(_started) | (_ray_running() - ray_before)


def _fixture_kinds(item: pytest.Item) -> set[str]:
    """What the fixtures the test uses started: for each name the definition in force (a module's
    own `engine` overrides conftest's), and the one it overrides only if it asks for it by name."""
    kinds: set[str] = set()
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in reversed(info.name2fixturedefs.get(name, ()) if info else ()):
            kinds |= getattr(fixturedef, "palaestra_started", set())
            if name not in fixturedef.argnames:
                break
    return kinds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    started = getattr(item, "palaestra_started", set()) | _fixture_kinds(item)
    missing = sorted(k for k in started if item.get_closest_marker(k) is None)
    if missing:
        report.outcome = "failed"
        marks = ", ".join(f"@pytest.mark.{k}" for k in missing)
        report.longrepr = (
            f"{item.nodeid} starts {' and '.join(missing)} but is not marked: add {marks} (to the "
            "test, or `pytestmark` for its module) so that `make test-fast` and `pytest -m` select "
            "it honestly (tests/support/markers.py)"
        )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test in its xdist group: the first of `GROUPS` it is marked with, else its module; the
    groups of `GROUPS` queued first (the same order in every worker)."""

    def group(item: pytest.Item) -> str:
        return next((g for g in GROUPS if item.get_closest_marker(g) is not None), item.nodeid.split("::")[0])

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group(item)))
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the scheduler's queue
        rank = {g: i for i, g in enumerate(GROUPS)}
        items.sort(key=lambda item: rank.get(group(item), len(GROUPS)))  # stable: modules keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker under `--dist loadgroup`, xdist keeps a group together by appending
    `@group` to each test's node id. pytest 9.2 made `nodeid` read a field xdist 3.8 does not set:
    the suffix vanished, every group was spread over both workers (two train runs at once on two
    cores) and nothing said so. If the suffix is missing, stop before any test runs."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup") or not session.items:
        return
    if "@" not in session.items[0].nodeid:
        import xdist

        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} drops the xdist_group "
            f"suffix from node ids ({session.items[0].nodeid!r}), so `--dist loadgroup` would not keep "
            "groups on one worker: install the versions pyproject.toml pins (`make install`)"
        )
