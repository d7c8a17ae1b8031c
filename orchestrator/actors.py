"""The boxes of a training run, as classes Ray runs as actors (`cluster.Cluster` places them).

* `ServerHost` — one HTTP server subprocess: an inference engine (embedded or SGLang), the
  sglang-router or the gateway. It answers with the server's URL and reports the process's exit
  code and log tail, so the driver can say *which* box died and why. Ray kills the subprocess with
  its actor (per-worker process groups), so a crashed driver leaves nothing behind.
* `RolloutWorker` — the environment runner: groups of `samples_per_task` sessions per task through
  the gateway (`palaestra.sdk.runner.run_rollouts`, with the run's sampling settings), either a
  given range of task indices (sync, one-step-off) or a continuous stream bounded by an admission
  limit (async). Each finished group comes back as a `batching.GroupRecord`. Every session it opens
  and finishes is noted in a ledger file, so that when its process dies the driver finishes the
  sessions it left open as aborted (`ledger.py`).
* `TrainerWorker` — one rank of the Megatron trainer (`palaestra.trainer.Trainer`); RANK,
  WORLD_SIZE and MASTER_ADDR/PORT come from the driver (gloo on CPU, nccl on GPU). Model names
  (presets) are resolved to directories here: the trainer takes directories only.

The classes are plain Python: `ray.remote(cls)` makes them actors, and tests may use them directly.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palaestra.orchestrator.batching import TRAINABLE, GroupRecord
from palaestra.orchestrator.ledger import group_run_id, ledgered_client

__all__ = ["RolloutWorker", "ServerHost", "TaskSource", "TrainerWorker", "node_address", "score"]

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def node_address(host: str) -> tuple[str, str]:
    """(address to connect to from this node, address to advertise to other nodes) for a bind host.

    Loopback stays loopback; a wildcard bind is reached locally on 127.0.0.1 and advertised as the
    node's IP (as Ray sees it); a specific address is both.
    """
    if host in WILDCARD_HOSTS:
        import ray

        return "127.0.0.1", ray.util.get_node_ip_address()
    return host, host


def where() -> str:
    """This actor's node, for the placement printed at start: "<address> (node <id prefix>)"."""
    import ray

    return f"{ray.util.get_node_ip_address()} (node {ray.get_runtime_context().get_node_id()[:8]})"


def _single_node() -> bool:
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


# ----------------------------------------------------------------------------------------------
# HTTP servers: engines, router, gateway
# ----------------------------------------------------------------------------------------------
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
        )
        self.proc.start()
        self.url = f"http://{advertise}:{port}"
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
        from palaestra.net import free_port

        connect, advertise = node_address(host)
        self.proc = RouterProcess(
            worker_urls,
            host=host,
            port=free_port(connect),
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

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, max_chars: int = 2000) -> str:
        return self.proc.log_tail(max_chars) if self.proc is not None else ""

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc is not None else None

    def restart(self) -> str:
        """The server again, with the same command on the same port (the URL every client holds
        stays valid; the gateway keeps its spool directory and keys); returns its URL."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        self.proc.restart()
        assert self.url is not None
        return self.url


# ----------------------------------------------------------------------------------------------
# The environment runner
# ----------------------------------------------------------------------------------------------
class TaskSource:
    """Task `i` of `env.tasks(seed)`, for any i: a finite task list wraps around, pass p reading
    `env.tasks(seed + p)`. Sequential reads are O(1); going back restarts the iterator."""

    def __init__(self, env, seed: int):
        self.env, self.seed = env, seed
        self.length: int | None = None
        self._start(0)

    def _start(self, epoch: int) -> None:
        self._epoch, self._pos, self._last = epoch, 0, None
        self._it = iter(self.env.tasks(self.seed + epoch))

    def get(self, index: int) -> Any:
        from palaestra.sdk.environment import check_task

        epoch, offset = divmod(index, self.length) if self.length else (0, index)
        if epoch != self._epoch or offset < self._pos - 1:
            self._start(epoch)
        if offset == self._pos - 1:
            return self._last
        while self._pos <= offset:
            try:
                self._last = next(self._it)
                check_task(self.env, self._last)  # the task contract, with what to change
            except StopIteration:
                if self._pos == 0:
                    raise ValueError(f"environment {self.env.name!r}: tasks() yielded no task") from None
                self.length = self._pos
                return self.get(index)
            self._pos += 1
        return self._last


class RolloutWorker:
    """Runs the environment's rollouts through the gateway (a Ray async actor: one event loop)."""

    def __init__(
        self,
        env_name: str,
        env_args: dict[str, Any],
        sampling: dict[str, Any],
        gateway_url: str,
        api_key: str,
        seed: int,
        samples_per_task: int,
        concurrency: int,
        run_id: str,
        ledger: str | None = None,
    ):
        from palaestra.sdk import load_environment

        self.env = load_environment(env_name, **env_args)
        # Every session gets these (`session.sampling`, plus its episode's seed): the trainer's
        # logprobs are only right at the temperature the rollouts were sampled at.
        self.sampling = dict(sampling)
        self.env_name, self.env_args = env_name, env_args
        self.gateway = ledgered_client(gateway_url, api_key, ledger)
        self.tasks = TaskSource(self.env, seed)
        self.tasks.get(0)  # a task without a task_id fails the start, not the first step
        self.seed = seed
        self.samples_per_task = samples_per_task
        self.group_slots = max(1, concurrency // samples_per_task)
        self.run_id = run_id
        self._slots = asyncio.Semaphore(self.group_slots)
        self._done: list[GroupRecord] = []
        self._in_flight: set[int] = set()
        self._stream: asyncio.Task | None = None
        self._stream_error: str | None = None
        self._allowed = self._started = 0
        self._allowed_changed = asyncio.Event()

    def info(self) -> dict[str, Any]:
        return {"env": self.env.name, "sampling": self.sampling, "node": where(), "pid": os.getpid()}

    async def _group(self, index: int, attempt: int) -> GroupRecord:
        from palaestra.sdk.runner import run_rollouts

        task = self.tasks.get(index)
        started = time.time()
        summary = await run_rollouts(
            self.env,
            self.gateway,
            [task],
            samples_per_task=self.samples_per_task,
            concurrency=self.samples_per_task,
            progress=False,
            run_id=group_run_id(self.run_id, index, attempt),
            sampling=self.sampling,
            seed=f"{self.seed}/{index}",  # group `index` samples alike in every run of this seed
        )
        ok = [r for r in summary.results if r.status in TRAINABLE]
        keys = sorted({k for r in ok for k in r.metrics})
        return GroupRecord(
            task_index=index,
            task_id=str(task.task_id),
            group_id=summary.results[0].group_id,
            sample_ids=[s for r in ok for s in r.sample_ids],
            rewards=[r.reward for r in ok],
            statuses=dict(Counter(r.status for r in summary.results)),
            metrics={k: statistics.fmean(r.metrics.get(k, 0.0) for r in ok) for k in keys},
            sampled_tokens=sum(r.sampled_tokens for r in ok),
            started=started,
            finished=time.time(),
            errors=[r.error for r in summary.results if r.error][:3],
        )

    async def _slotted(self, index: int, attempt: int) -> GroupRecord:
        try:
            return await self._group(index, attempt)
        finally:
            self._in_flight.discard(index)
            self._slots.release()

    async def run_groups(self, indices: Sequence[int], attempt: int = 0) -> list[GroupRecord]:
        """The groups of these task indices (at most `concurrency` sessions at once), in order;
        `attempt` tells groups redone after a fault from the first try (`group_run_id`)."""

        async def one(i: int) -> GroupRecord:
            await self._slots.acquire()
            self._in_flight.add(i)
            return await self._slotted(i, attempt)

        return list(await asyncio.gather(*(one(i) for i in indices)))

    # -- async mode: a continuous stream -------------------------------------------------------
    async def start_stream(self, first: int, skip: Sequence[int], allowed: int, attempt: int = 0) -> None:
        """Starts groups for task indices first, first+1, ... (leaving out `skip`) while fewer than
        `allowed` groups have been started by this stream and a group slot is free."""
        if self._stream is not None:
            raise RuntimeError("the rollout stream is already running")
        self._allowed, self._started = allowed, 0
        self._stream = asyncio.get_running_loop().create_task(self._run_stream(first, set(skip), attempt))

    async def _run_stream(self, index: int, skip: set[int], attempt: int) -> None:
        def record(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                self._stream_error = f"{type(task.exception()).__name__}: {task.exception()}"
            else:
                self._done.append(task.result())

        pending: set[asyncio.Task] = set()
        try:
            while True:
                while index in skip:
                    index += 1
                while self._started >= self._allowed:
                    self._allowed_changed.clear()
                    await self._allowed_changed.wait()
                await self._slots.acquire()
                self._started += 1
                self._in_flight.add(index)
                task = asyncio.get_running_loop().create_task(self._slotted(index, attempt))
                task.add_done_callback(record)
                pending.add(task)
                task.add_done_callback(pending.discard)
                index += 1
        except asyncio.CancelledError:
            for task in pending:
                task.cancel()
            # Their sessions finish (as failed) before the stream counts as stopped, so the run's
            # last read of the spool sees every sample they leave.
            await asyncio.gather(*pending, return_exceptions=True)
            raise

    async def allow(self, allowed: int) -> None:
        """Raises the admission limit: the stream may have started `allowed` groups in all."""
        self._allowed = max(self._allowed, allowed)
        self._allowed_changed.set()

    async def take_finished(self) -> list[GroupRecord]:
        """Groups finished since the last call (async mode)."""
        if self._stream_error is not None:
            raise RuntimeError(f"the rollout stream failed: {self._stream_error}")
        done, self._done = self._done, []
        return done

    async def stop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            try:
                await self._stream
            except asyncio.CancelledError:
                pass
            self._stream = None

    async def status(self) -> dict[str, Any]:
        return {"in_flight_groups": sorted(self._in_flight), "finished_waiting": len(self._done)}

    # -- held-out evaluation -------------------------------------------------------------------
    async def evaluate(self, n: int, seed: int, tag: str, concurrency: int) -> dict[str, float]:
        """Greedy accuracy on `n` tasks of `env.tasks(seed)`: the `correct` metric, else reward > 0."""
        from palaestra.sdk import load_environment
        from palaestra.sdk.runner import run_rollouts, take_tasks

        env = load_environment(self.env_name, **self.env_args)
        tasks = take_tasks(env, n, seed)
        summary = await run_rollouts(
            env,
            self.gateway,
            tasks,
            samples_per_task=1,
            concurrency=concurrency,
            progress=False,
            run_id=f"eval-{self.run_id}-{tag}",
            sampling={**self.sampling, "temperature": 0.0},
        )
        return {**score(tasks, summary.results), "reward_mean": summary.reward_mean, "wall_s": summary.wall_s}

    async def close(self) -> None:
        await self.stop_stream()
        await self.gateway.close()


def score(tasks: Sequence[Any], results: Sequence[Any]) -> dict[str, float]:
    """Held-out accuracy of `results` (`RolloutResult`s of `tasks`; failed ones are counted apart).
    Tasks of several kinds (a `kind` attribute, e.g. math's arithmetic and worked_steps) also get
    each kind's ``accuracy/<kind>`` and ``tasks/<kind>``, so a multi-domain run shows what each
    domain gained."""
    scored = [r for r in results if r.status != "failed"]
    out = {
        "accuracy": _accuracy(scored),
        "tasks": float(len(scored)),
        "failed": float(len(results) - len(scored)),
    }
    kind_of = {str(t.task_id): getattr(t, "kind", None) for t in tasks}
    kinds = sorted({k for k in kind_of.values() if isinstance(k, str)})
    if len(kinds) > 1:
        for kind in kinds:
            of_kind = [r for r in scored if kind_of.get(r.task_id) == kind]
            out[f"accuracy/{kind}"] = _accuracy(of_kind)
            out[f"tasks/{kind}"] = float(len(of_kind))
    return out


def _accuracy(results: Sequence[Any]) -> float:
    """The share of `results` whose `correct` metric (else reward > 0) is set; nan for none."""
    correct = sum(r.metrics.get("correct", float(r.reward > 0)) for r in results)
    return correct / len(results) if results else float("nan")


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------
class TrainerWorker:
    """One rank of the Megatron trainer. Every rank must be called for collective methods
    (train, sync_weights, save, load, export_hf); rank 0's samples are the ones used."""

    def __init__(self, rank: int, world_size: int, reserve_threads: int):
        import torch

        # Ray sets OMP_NUM_THREADS to the actor's (logical) CPUs; the ranks share this machine's
        # cores instead, less those left to engines beside them (`engine_threads_beside_trainer`).
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - reserve_threads) // world_size))
        # Importing megatron-core takes seconds: done here, while the engines start.
        from palaestra.trainer import cpu_shim

        cpu_shim.import_megatron()
        import palaestra.trainer.trainer  # noqa: F401

        self.rank, self.world_size = rank, world_size
        self.trainer = None

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's address, a free port on it): rank 0's answer is every rank's MASTER_ADDR/PORT
        (127.0.0.1 for a single-node cluster, so nothing listens beyond loopback)."""
        from palaestra.net import free_port

        address = "127.0.0.1" if _single_node() else node_address("0.0.0.0")[1]
        return address, free_port(address)

    def build(
        self,
        config: dict[str, Any],
        model: str,
        engine_urls: Sequence[str],
        master: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Builds the Megatron trainer of `model` (a preset or a directory; `engine_urls`: the
        engines that get its weights), joining rank 0's rendezvous `master` when there are several
        ranks. A megatron-mode teacher named by preset is resolved too."""
        from palaestra.models import resolve_model
        from palaestra.trainer import Trainer, TrainerConfig

        if self.world_size > 1:  # one process needs no rendezvous (the trainer uses an in-memory store)
            assert master is not None, "several trainer ranks need rank 0's rendezvous address"
            os.environ.update(
                RANK=str(self.rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK="0",  # Ray gives each rank its own device: it is device 0 of the actor
                MASTER_ADDR=master[0],
                MASTER_PORT=str(master[1]),
            )

        config = dict(config)
        if config.get("teacher_model"):
            config["teacher_model"] = str(resolve_model(config["teacher_model"]))
        config["teachers"] = {  # a panel's megatron teachers too
            name: {**spec, "model": str(resolve_model(spec["model"]))} if spec.get("model") else spec
            for name, spec in (config.get("teachers") or {}).items()
        }
        self.trainer = Trainer(TrainerConfig.from_dict(config), resolve_model(model), engine_urls=engine_urls)
        return self.ready()

    def ready(self) -> dict[str, Any]:
        import torch

        return {
            "rank": self.rank,
            "node": where(),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "weight_version": self.trainer.weight_version,
        }

    def train(self, samples: list) -> dict[str, float]:
        """One optimizer step on `samples`, without the weight sync: the loop syncs apart
        (one-step-off waits for the next batch's generation first; async pauses the gateway)."""
        return self.trainer.step(samples, sync=False)

    def sync_weights(self) -> tuple[int, dict[str, float]]:
        """The live weights onto every engine: (the weight version they now hold, metrics). The
        trainer owns the version; the driver reads it here."""
        started = time.perf_counter()
        metrics = self.trainer.sync_weights()
        metrics.setdefault("perf/sync_s", time.perf_counter() - started)
        return self.trainer.weight_version, metrics

    def weight_version(self) -> int:
        return self.trainer.weight_version

    def synced_weights_dir(self) -> str | None:
        """Where the weights of the last sync lie as a safetensors directory an engine can load
        (sync_mode shm: the shared-memory file; disk: that version's directory), or None. The
        driver reads it after every sync, so an engine restarted later gets exactly the weights the
        others hold, even while the trainer is busy with the next step."""
        sync = self.trainer.sync
        path = sync.pushed_directory(self.trainer.weight_version) if sync is not None else None
        return str(path) if path is not None else None

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str) -> dict[str, int]:
        self.trainer.load(path)
        return {"step": self.trainer.step_count, "weight_version": self.trainer.weight_version}

    def export_hf(self, path: str) -> str:
        return str(self.trainer.export_hf(path))

    def teacher_logprobs(self, samples: list) -> list[list[float]] | None:
        """Per sample, its teacher's logprob of each response token (for the trajectory viewer);
        None without a teacher."""
        return self.trainer.teacher_logprobs(samples)
