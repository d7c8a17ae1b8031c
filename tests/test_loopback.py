"""Every server a run starts listens on loopback unless configured otherwise.

Each test starts the real servers (embedded engine, sglang-router with its Prometheus port, the
gateway, the sandbox exec server and the compose fleet's front; torch.distributed's rendezvous store and gloo; Ray as
`init_ray` starts it for a one-machine run) and reads
what their processes listen on from /proc: the LISTEN sockets of /proc/net/tcp{,6} whose inodes
are among the open files of the process tree. Every one must be on 127.0.0.1 (or ::1), and the
ports the launcher says it opened must be among them (so an empty list cannot pass).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_loopback.py
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from palaestra.engine.cli import engine_process
from palaestra.engine.router import RouterProcess
from palaestra.gateway.cli import gateway_process
from palaestra.net import free_port
from palaestra.rendezvous import tcp_store
from tests.support.listening import assert_loopback_only, listening, process_tree
from tests.support.sandbox import exec_server

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from Linux /proc")


def test_listening_sockets_are_read_from_proc():
    """The reader itself: a socket this process binds on the wildcard address is seen as exposed."""
    with socket.socket() as wide, socket.socket() as narrow:
        wide.bind(("0.0.0.0", 0))
        narrow.bind(("127.0.0.1", 0))
        wide.listen()
        narrow.listen()
        mine = listening(os.getpid())
        assert ("0.0.0.0", wide.getsockname()[1]) in mine
        assert ("127.0.0.1", narrow.getsockname()[1]) in mine


@pytest.mark.slow  # four servers start (engine, router, gateway, exec server)
@pytest.mark.engine
def test_engine_router_gateway_and_exec_server_listen_on_loopback_only(tiny_model_dir, tmp_path):
    key = secrets.token_hex(8)
    keys = {**os.environ, "PALAESTRA_API_KEY": key, "PALAESTRA_ADMIN_KEY": key + "-admin"}
    with engine_process("tiny", extra_args=["--num-threads", "1"]) as engine:
        with RouterProcess([engine.url]) as router:
            with gateway_process("tiny", router.url, str(tmp_path / "spool"), env=keys) as gateway:
                with exec_server(key) as sandbox:
                    for name, server, ports in (
                        ("engine", engine, {int(engine.url.rsplit(":", 1)[1])}),
                        ("router", router, {router.port, router.prometheus_port}),
                        ("gateway", gateway, {int(gateway.url.rsplit(":", 1)[1])}),
                        ("sandbox exec server", sandbox, {int(sandbox.url.rsplit(":", 1)[1])}),
                    ):
                        assert server.pid is not None
                        assert_loopback_only(name, server.pid, ports)


def test_compose_front_without_a_host_listens_on_loopback(tmp_path):
    """`palaestra.sandbox.front --listen :PORT` (no host) serves on 127.0.0.1; it needs no replica to
    listen (its /health waits for one), so its sockets are read as soon as the port appears."""
    port = free_port()
    front = subprocess.Popen(
        [sys.executable, "-m", "palaestra.sandbox.front", "--listen", f":{port}", "--sockets", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while port not in {p for _, p in listening(front.pid)}:
            assert front.poll() is None and time.monotonic() < deadline, "the front never listened"
            time.sleep(0.1)
        assert_loopback_only("compose sandbox front", front.pid, {port})
    finally:
        front.terminate()
        front.wait(timeout=30)


def test_rendezvous_store_listens_on_its_address_only():
    """torch's own TCPStore takes every interface whatever host it is given (why palaestra/rendezvous.py
    exists); `tcp_store` listens on the host only, and a plain TCPStore client still joins it."""
    timeout = datetime.timedelta(seconds=30)
    torchs = __import__("torch.distributed", fromlist=["TCPStore"]).TCPStore(
        "127.0.0.1", 0, 1, True, timeout, wait_for_workers=False
    )
    assert {a for a, p in listening(os.getpid()) if p == torchs.port} == {"::"}  # the fact, as of torch 2.13
    del torchs

    port = free_port()
    client: list = []
    joiner = threading.Thread(target=lambda: client.append(tcp_store("127.0.0.1", port, 1, 2, timeout)))
    joiner.start()
    master = tcp_store("127.0.0.1", port, 0, 2, timeout)  # returns once rank 1 has joined
    joiner.join(30)
    assert {a for a, p in listening(os.getpid()) if p == port} == {"127.0.0.1"}
    client[0].set("from-rank-1", "hello")
    assert master.get("from-rank-1") == b"hello"


WORKER = textwrap.dedent(
    """
    import sys, torch.distributed as dist
    from palaestra.trainer.megatron_model import init_parallel
    init_parallel({"tensor_model_parallel_size": 1})
    t = __import__("torch").ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("ready", float(t), flush=True)
    sys.stdin.readline()  # the test reads our sockets meanwhile
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_two_trainer_ranks_rendezvous_and_talk_on_loopback_only(tmp_path):
    """`init_parallel` as a run's trainer ranks call it (env://, MASTER_ADDR=127.0.0.1): rank 0's store
    and both ranks' gloo sockets listen on loopback only."""
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("GLOO_SOCKET_IFNAME", None)  # init_parallel must choose loopback itself
    env["OMP_NUM_THREADS"] = "1"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        for proc in ranks:
            output = []
            while not (output and output[-1].startswith("ready")) and (line := proc.stdout.readline()):
                output.append(line)  # warnings may come first
            assert output and output[-1] == "ready 3.0\n", "".join(output)  # the all-reduce summed 1 + 2
        assert_loopback_only("trainer rank 0", ranks[0].pid, {port})
        assert_loopback_only("trainer rank 1", ranks[1].pid, set())
        for proc in ranks:
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in ranks:
            assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()


RAY_DRIVER = textwrap.dedent(
    """
    import os, sys
    from palaestra.orchestrator.cluster import init_ray
    init_ray("127.0.0.1", num_cpus=1)
    import ray

    @ray.remote(num_cpus=0)
    class Box:
        def pid(self):
            return os.getpid()

    box = Box.remote()
    print("ready", ray.get(box.pid.remote()), ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.readline()  # the test reads our sockets meanwhile
    ray.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_of_a_one_machine_run_listens_on_loopback_only():
    """`init_ray("127.0.0.1")` as `palaestra train` calls it: GCS, raylet, object manager, agents and
    an actor's worker (all children of the driver) listen on loopback only."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    }
    driver = subprocess.Popen(
        [sys.executable, "-c", RAY_DRIVER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("ready"), line
        _, actor_pid, gcs_address = line.split()
        gcs_port = int(gcs_address.rsplit(":", 1)[1])
        sockets = assert_loopback_only("ray", driver.pid, {gcs_port})
        assert int(actor_pid) in process_tree(driver.pid) and listening(int(actor_pid)) <= sockets
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(timeout=120) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
