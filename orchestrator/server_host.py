"""`ServerHost`, the Ray actor that runs one HTTP server subprocess: an inference engine (embedded
or SGLang), the sglang-router, a gateway (or shard) or the front of gateway shards (`cluster.Cluster`
places it).

It answers with the server's URL and reports the process's exit code and log tail, so the driver
can say *which* box died and why; `restart` brings the same command back on the same port. Ray
kills the subprocess with its actor (per-worker process groups), so a crashed driver leaves nothing
behind. The class is plain Python: `ray.remote(ServerHost)` makes it an actor, tests may use it
directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from palaestra.orchestrator.nodes import node_address, where

__all__ = ["ServerHost"]


class ServerHost:
    """Runs one server subprocess (`palaestra.net.ServerProcess`) on this actor's node."""

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = None
        self.url: str | None = None

    def where(self) -> str:
        return where()

    def node_id(self) -> str:
        """The Ray node this actor runs on (the driver asks whether it is still alive)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def _run(self, argv: list[str], host: str, port: int, *, env=None, timeout: float = 300.0) -> str:
        from palaestra.net import ServerProcess

        connect, advertise = node_address(host)
        self.proc = ServerProcess(
            argv,
            f"http://{connect}:{port}",
            name=self.name,
            log_path=self.log_path,
            env=env,
            startup_timeout=timeout,
            free_ports=["--port"],  # picked here: a fresh one if another process takes it first
        )
        self.proc.start()
        self.url = f"http://{advertise}:{self.proc.port_of('--port')}"
        return self.url

    def start_engine(
        self,
        backend: str,
        model: str,
        flags: Sequence[str],
        host: str,
        weight_version: str,
        startup_timeout: float,
    ) -> str:
        """An embedded engine (`palaestra engine serve`) or SGLang (`palaestra sglang launch`)."""
        from palaestra.models import resolve_model
        from palaestra.net import free_port

        port = free_port(node_address(host)[0])
        if backend == "embedded":
            from palaestra.engine.cli import engine_process

            argv = engine_process(model, port=port, host=host).argv
            argv += [*flags, "--weight-version", weight_version]
        else:
            from palaestra.engine import sglang_launcher

            reason = sglang_launcher.unavailable_reason()
            if reason is not None:
                raise sglang_launcher.SGLangUnavailable(reason)
            passthrough = [*flags, "--sglang-weight-version", weight_version]
            argv = sglang_launcher.build_command(str(resolve_model(model)), host, port, passthrough)
        return self._run(argv, host, port, timeout=startup_timeout)

    def start_router(self, worker_urls: Sequence[str], options: Sequence[str], host: str) -> str:
        from palaestra.engine.router import RouterProcess

        connect, advertise = node_address(host)
        self.proc = RouterProcess(
            worker_urls,
            host=host,
            router_options=list(options),
            log_path=str(self.log_path),
            log_level="warn",
        )
        self.proc.url = f"http://{connect}:{self.proc.port}"  # a wildcard bind is polled on loopback
        self.proc.start()
        self.url = f"http://{advertise}:{self.proc.port}"
        return self.url

    def start_gateway(
        self,
        model: str,
        engine_url: str,
        spool_dir: str,
        flags: Sequence[str],
        host: str,
        keys: dict[str, str],
    ) -> str:
        from palaestra.gateway.cli import gateway_process
        from palaestra.net import free_port

        port = free_port(node_address(host)[0])
        argv = gateway_process(model, engine_url, spool_dir, port=port).argv
        argv += [*flags, "--host", host]
        # Keys travel in the environment, not argv (argv is visible to every local user in `ps`).
        return self._run(argv, host, port, env=keys, timeout=180.0)

    def start_front(self, shard_urls: Sequence[str], host: str, event_loop: str = "auto") -> str:
        """The front of gateway shards (`palaestra gateway front`, gateway/shards.py), on the shards'
        `gateway.event_loop`; it holds no key."""
        from palaestra.gateway.shards import front_process
        from palaestra.net import free_port

        port = free_port(node_address(host)[0])
        argv = front_process(shard_urls, port=port, host=host, event_loop=event_loop).argv
        return self._run(argv, host, port, timeout=60.0)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, max_chars: int = 2000) -> str:
        return self.proc.log_tail(max_chars) if self.proc is not None else ""

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc is not None else None

    def restart(self, extra_args: Sequence[str] = ()) -> str:
        """The server again, with the same command (plus `extra_args`, this time only) on the same
        port (the URL every client holds stays valid; the gateway keeps its spool directory and
        keys); returns its URL."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        self.proc.restart(extra_args)
        assert self.url is not None
        return self.url
