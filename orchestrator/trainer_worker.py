"""`TrainerWorker`, the Ray actor that is one rank of the Megatron trainer
(`palaestra.trainer.Trainer`). RANK, WORLD_SIZE and MASTER_ADDR/PORT come from the driver (gloo on
CPU, nccl on GPU). Model names (presets) are resolved to directories here: the trainer takes
directories only.

The class is plain Python: `ray.remote(TrainerWorker)` makes it an actor, tests may use it directly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from palaestra.orchestrator.nodes import node_address, single_node, where

__all__ = ["TrainerWorker", "torch_threads"]


def torch_threads(reserve_threads: int, world_size: int, omp_num_threads: str | None) -> int:
    """Torch's intra-op threads for one rank: the driver's OMP_NUM_THREADS when it set one (a
    shared machine asks for 1), else this machine's cores less `reserve_threads`, split over the
    ranks. Inside the actor OMP_NUM_THREADS cannot tell the user's value from Ray's (the actor's
    CPUs), so the driver's is passed in."""
    if omp_num_threads is not None and omp_num_threads.strip():
        first = omp_num_threads.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level
        if not first.isdigit() or int(first) < 1:
            raise ValueError(
                f"OMP_NUM_THREADS={omp_num_threads!r} is not a positive integer: set it to e.g. 1, or unset it"
            )
        return int(first)
    return max(1, ((os.cpu_count() or 1) - reserve_threads) // world_size)


class TrainerWorker:
    """One rank of the Megatron trainer. Every rank must be called for collective methods
    (train, sync_weights, save, load, export_hf); rank 0's samples are the ones used."""

    def __init__(self, rank: int, world_size: int, reserve_threads: int, omp_num_threads: str | None = None):
        import torch

        # Without the driver's OMP_NUM_THREADS the ranks share this machine's cores, less those left
        # to engines beside them (`engine_threads_beside_trainer`): not Ray's per-actor CPU count.
        torch.set_num_threads(torch_threads(reserve_threads, world_size, omp_num_threads))
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

        address = "127.0.0.1" if single_node() else node_address("0.0.0.0")[1]
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

        opd = dict(config.get("opd") or {})
        config = {**config, "opd": opd}
        if opd.get("teacher_model"):
            opd["teacher_model"] = str(resolve_model(opd["teacher_model"]))
        opd["teachers"] = {  # a panel's megatron teachers too
            name: {**spec, "model": str(resolve_model(spec["model"]))} if spec.get("model") else spec
            for name, spec in (opd.get("teachers") or {}).items()
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

    def set_engines(self, urls: list[str]) -> None:
        """The engines the weight syncs reach from now on (`Cluster.replace_engine`)."""
        if self.trainer.sync is not None:
            self.trainer.sync.set_engines(urls)

    def synced_weights_dir(self) -> str | None:
        """Where the weights of the last sync lie as a safetensors directory an engine can load
        (sync.mode shm: the shared-memory file; disk: that version's directory), or None. The
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
