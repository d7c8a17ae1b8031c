"""The in-host fast path of weight sync: one safetensors file in shared memory, written in place.

    shm = SharedWeightsFile()                 # /dev/shm/palaestra-weights-<pid>-<random>/
    directory = shm.write(named)              # raw tensor bytes, dtype kept, one copy
    # every engine on this host: POST /update_weights_from_disk {"model_path": directory}
    shm.close()                               # removes the directory

The file is an ordinary ``model.safetensors`` (8-byte header length, JSON header, raw bytes), so
anything that reads safetensors loads it: real SGLang's ``/update_weights_from_disk`` copies it
into its weights, and so does the embedded engine by default. No JSON or base64 carries tensor
data, and bf16 stays bf16.

Shared, not copied (``load_format: "mmap"``, embedded engine only): the engine maps the file and
points its parameters at it, so a sync is a single copy — the trainer's write — however many
engines share the host. That is why the trainer writes **inside** the pause (`WeightSync.push`):
an engine whose parameters are this file sees every byte as it lands, and must not be computing.
It also fixes the file's life cycle: the file is rewritten in place while the names, dtypes and
shapes stay the same (every step of a run) and is never truncated while an engine may map it; a
new layout gets a new file and the old one is unlinked (an engine keeps its mapping until it
loads the new one). Tensors are laid out largest element size first, so every tensor starts at
a multiple of its own element size and can be used in place.

The writer keeps its own mapping open between syncs, so after the first sync no page is faulted
or allocated again: a write is one memcpy per tensor into page-cache pages, on the calling thread
(a multi-threaded copy per tensor measured several times slower on a loaded host: every tensor
waits for all threads to be scheduled).

In-host only: an engine on another node cannot see this host's /dev/shm; use ``sync.mode:
distributed`` there (`palaestra.trainer.sglang_sync`).

`ShmTransport` is ``sync.mode: shm`` (trainer/weight_sync.py): the file is written inside the
pause, then every engine gets ``/update_weights_from_disk`` of its directory, with ``load_format
"mmap"`` for the embedded engine (it shares the file's pages) and ``"safetensors"`` for SGLang.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from palaestra.net import is_this_host
from palaestra.trainer.sync_transport import Clock, Engines, TransportOptions
from palaestra.weights_format import safetensors_dtype

__all__ = ["SharedWeightsFile", "ShmTransport", "default_shm_root", "remove_dead_writer"]


def default_shm_root() -> Path:
    """/dev/shm where it exists (Linux), else the temp directory (still correct, not memory-backed)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The file header and (name, start, nbytes) per tensor, largest element size first."""
    order = sorted(range(len(named)), key=lambda i: -named[i][1].element_size())  # stable
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    spans, position = [], 0
    for i in order:
        name, t = named[i]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": safetensors_dtype(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [position, position + n],
        }
        spans.append((name, position, n))
        position += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 64)  # the data section starts 64-byte aligned
    return len(raw).to_bytes(8, "little") + raw, spans


def _release(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


def _remove_orphans(base: Path) -> None:
    """Removes the files of writers that died without cleaning up (a killed Ray actor runs no
    finalizer); the directory name carries the writer's pid. Shared memory is not freed otherwise."""
    for folder in base.glob("palaestra-weights-*-*"):
        try:
            pid = int(folder.name.split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue  # not ours to judge: another user's process, or not our naming


def remove_dead_writer(pid: int, root: str | Path | None = None) -> list[Path]:
    """Removes the shared-memory folders (`SharedWeightsFile`'s, LoRA sync's) of writer `pid` under
    `root` (default /dev/shm) if no process `pid` lives on this host: a trainer rank killed (no
    finalizer ran) leaves its file otherwise until the next writer starts. The folders removed."""
    try:
        os.kill(pid, 0)
        return []  # alive (or another user's): not ours to remove
    except ProcessLookupError:
        pass
    except PermissionError:
        return []
    base = Path(root) if root is not None else default_shm_root()
    gone = sorted(base.glob(f"palaestra-weights-{pid}-*"))
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


class SharedWeightsFile:
    """One ``model.safetensors`` under `root` (default /dev/shm), rewritten in place each sync."""

    def __init__(self, root: str | Path | None = None):
        base = Path(root) if root is not None else default_shm_root()
        _remove_orphans(base)
        self.directory = base / f"palaestra-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.directory.mkdir(parents=True, exist_ok=False)
        self.path: Path | None = None
        self._layouts = 0
        self._header: bytes | None = None
        self._spans: list[tuple[str, int, int]] = []
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # uint8 view of the whole mapping
        # shared memory outlives the process unless removed: also at garbage collection and exit
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def _new_file(self, header: bytes, size: int) -> None:
        """A fresh file for a new layout; the old one is unlinked, never truncated (engines may map it)."""
        self._bytes = None
        _release(self._map)
        if self.path is not None:
            shutil.rmtree(self.path.parent, ignore_errors=True)
        self._layouts += 1
        folder = self.directory / f"layout-{self._layouts}"
        folder.mkdir()
        self.path = folder / "model.safetensors"
        with open(self.path, "w+b") as f:
            f.truncate(size)
            self._map = mmap.mmap(f.fileno(), size)  # MAP_SHARED, read-write; outlives the fd
        self._map[: len(header)] = header
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def write(self, named: Sequence[tuple[str, torch.Tensor]]) -> Path:
        """Writes `named` (HF names) into the file; returns the directory to hand to the engines."""
        if not named:
            raise ValueError("no tensors to write")
        tensors = dict(named)
        if len(tensors) != len(named):
            raise ValueError("duplicate tensor names in the weight update")
        header, spans = _layout(named)
        if header != self._header:  # first write, or the layout changed
            self._new_file(header, len(header) + sum(n for _, _, n in spans))
            self._header, self._spans = header, spans
        assert self._bytes is not None and self.path is not None
        # One plain memcpy per tensor on this thread (ctypes releases the GIL meanwhile). Not
        # torch's copy_: it splits every tensor over its intra-op threads and joins them, and on a
        # loaded host each of those joins waits for a descheduled thread (several times slower).
        # The header, equal to this write's layout, guarantees each tensor's size is its span's.
        base = self._bytes.data_ptr() + len(header)
        for name, start, n in self._spans:
            if n:
                src = tensors[name].detach().to("cpu").contiguous()
                ctypes.memmove(base + start, src.data_ptr(), n)
        return self.path.parent

    @property
    def nbytes(self) -> int:
        return self._map.size() if self._map is not None else 0

    def close(self) -> None:
        self._bytes = None
        _release(self._map)
        self._map = None
        self._cleanup()

    def __enter__(self) -> SharedWeightsFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class ShmTransport:
    """``sync.mode: shm`` (module docstring): one `SharedWeightsFile` on this host, made by the
    first push and rewritten in place by every later one."""

    def __init__(self, engines: Engines, options: TransportOptions):
        elsewhere = [u for u in engines.urls if not is_this_host(u)]
        if elsewhere:
            raise ValueError(
                f"sync.mode 'shm' needs every engine on this host (its /dev/shm); {elsewhere[0]} is "
                "not: use sync.mode 'distributed' for engines on other nodes"
            )
        self.engines = engines
        self.root = options.disk_dir  # None: /dev/shm (a directory of its own, e.g. for tests)
        self.file: SharedWeightsFile | None = None
        self._formats: dict[str, str] = {}  # load_format per engine URL

    def stage(self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock) -> Sequence:
        with clock.phase("stage"):  # nothing to do: the file is written inside the pause
            return named

    def send(self, named: Sequence[tuple[str, torch.Tensor]], version: str, clock: Clock) -> int:
        """Writes the file (an embedded engine's weights are its pages), then every engine loads it."""
        with clock.phase("write"):
            if self.file is None:
                self.file = SharedWeightsFile(self.root)
            self.engines.changing()
            directory = str(self.file.write(named))
        body = {"model_path": directory, "flush_cache": True, "weight_version": version}

        def update(url: str) -> None:
            self.engines.call(url, "update 1/1", "POST", "/update_weights_from_disk",
                              {**body, "load_format": self._format(url)})  # fmt: skip

        clock.step("update", self.engines.each(update))
        return 1

    def _format(self, url: str) -> str:
        """ "mmap" for the embedded engine (it shares the file's pages: no copy), else "safetensors"."""
        if url not in self._formats:
            embedded = self.engines.server_info(url).get("engine") == "palaestra-embedded"
            self._formats[url] = "mmap" if embedded else "safetensors"
        return self._formats[url]

    def done(self, staged: object, version: str, clock: Clock) -> None:
        pass

    def directory(self, version: str) -> Path | None:
        """The file's directory (rewritten only inside the next push)."""
        return self.file.path.parent if self.file is not None and self.file.path is not None else None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
