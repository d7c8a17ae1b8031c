"""Weight-sync building blocks without an engine process: the shared-memory safetensors file, the
engine's in-place safetensors loader, dtype-preserving buckets, the SGLang payload shapes, and the
order of the sync's steps over several engines (against a labelled in-process test double)."""

from __future__ import annotations

import base64
import io
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from palaestra.engine.protocol import RequestError
from palaestra.engine.weights import SharedSafetensors, load_safetensors_into
from palaestra.trainer.shm_sync import SharedWeightsFile
from palaestra.trainer.weight_sync import WeightSync, make_buckets
from palaestra.weights_format import (
    SAFETENSORS_DTYPES,
    deserialize_named_tensors,
    safetensors_dtype,
    serialize_named_tensors,
)


def named_mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.bias", torch.randn(2, 2, generator=g).to(torch.float16)),
        ("d.empty", torch.zeros(0, 4)),
    ]


def test_shared_file_is_plain_safetensors_with_dtypes_kept_and_rewritten_in_place(tmp_path):
    named = named_mixed()
    with SharedWeightsFile(tmp_path) as shm:
        directory = shm.write(named)
        (file,) = directory.glob("*.safetensors")
        inode = os.stat(file).st_ino
        loaded = load_file(str(file))  # the reference reader agrees with our writer
        assert set(loaded) == {n for n, _ in named}
        for name, t in named:
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
        # the next version: same layout -> same file (an engine may map it), new bytes
        named2 = [(n, t * 2) for n, t in named]
        assert shm.write(named2) == directory and os.stat(file).st_ino == inode
        assert torch.equal(load_file(str(file))["b.weight"], named2[1][1])
        # a different layout gets a new file; the old one is unlinked, never truncated
        other = shm.write([("a.weight", torch.ones(4))])
        assert other != directory and not file.exists()
        assert list(load_file(str(next(other.glob("*.safetensors"))))) == ["a.weight"]
        with pytest.raises(ValueError, match="duplicate"):
            shm.write([("x", torch.ones(1)), ("x", torch.ones(1))])
    assert not shm.directory.exists()  # close() removes the shared memory
    # a writer killed without cleaning up (no finalizer runs): the next writer removes its file
    orphan = tmp_path / "palaestra-weights-999999999-deadbeef"  # above any pid_max: no such process
    orphan.mkdir()
    with SharedWeightsFile(tmp_path):
        assert not orphan.exists()


def test_every_safetensors_dtype_written_by_the_shared_file_is_read_back_by_the_engine(tmp_path):
    """One dtype table (engine/weights.py) for the engine's reader and the trainer's writers."""
    named = [
        (f"t.{code}", torch.arange(6).reshape(2, 3).to(dtype)) for code, dtype in SAFETENSORS_DTYPES.items()
    ]
    with SharedWeightsFile(tmp_path) as shm:
        directory = shm.write(named)
        params = {name: torch.zeros_like(t) for name, t in named}
        assert load_safetensors_into(directory, params) == len(named)
        for name, t in named:
            assert params[name].dtype == t.dtype and torch.equal(params[name], t), name
    assert all(safetensors_dtype(dtype) == code for code, dtype in SAFETENSORS_DTYPES.items())
    with pytest.raises(ValueError, match="complex64 cannot be written to safetensors .it holds F64, F32"):
        safetensors_dtype(torch.complex64)


def test_engine_shares_the_file_and_sees_the_next_write_without_a_copy(tmp_path):
    params = {"a.weight": torch.zeros(3, 5), "b.weight": torch.zeros(7), "c.bias": torch.zeros(2, 2)}
    named = [("a.weight", torch.randn(3, 5)), ("b.weight", torch.randn(7).to(torch.bfloat16)),
             ("c.bias", torch.randn(2, 2))]  # fmt: skip
    shared = SharedSafetensors()
    with SharedWeightsFile(tmp_path) as shm:
        directory = shm.write(named)
        assert shared.share(directory, params) == 3
        assert torch.equal(params["a.weight"], named[0][1])
        assert torch.equal(params["b.weight"], named[1][1].float())  # other dtype: copied, converted
        ptr = params["a.weight"].data_ptr()
        shm.write([(n, t + 1) for n, t in named])  # the next version, while "paused"
        assert torch.equal(params["a.weight"], named[0][1] + 1)  # already there: same memory
        assert shared.share(directory, params) == 3 and params["a.weight"].data_ptr() == ptr
        assert torch.equal(params["b.weight"], (named[1][1] + 1).float())
        with pytest.raises(RequestError, match="shape mismatch for c.bias"):
            shared.share(shm.write([("c.bias", torch.ones(4))]), params)


def test_engine_loader_reads_into_parameters_and_validates_before_writing(tmp_path):
    params = {
        "a.weight": torch.zeros(3, 5),  # same dtype: bytes read straight in
        "b.weight": torch.zeros(7),  # bf16 in the file -> converted to the model's float32
        "c.bias": torch.zeros(2, 2, dtype=torch.float16),
        "d.empty": torch.zeros(0, 4),
    }
    with SharedWeightsFile(tmp_path) as shm:
        shm.write(named_mixed())
        ptr = params["a.weight"].data_ptr()
        assert load_safetensors_into(shm.path.parent, params) == 4
        assert params["a.weight"].data_ptr() == ptr  # in place
        for name, t in named_mixed():
            assert torch.equal(params[name], t.to(params[name].dtype)), name
        before = {k: v.clone() for k, v in params.items()}
        # a file naming an unknown tensor or a wrong shape changes nothing
        shm.write([("a.weight", torch.ones(3, 5)), ("zzz", torch.ones(1))])
        with pytest.raises(RequestError, match="unknown parameter 'zzz'"):
            load_safetensors_into(shm.path.parent, params)
        shm.write([("a.weight", torch.ones(3, 5)), ("b.weight", torch.ones(8))])
        with pytest.raises(RequestError, match="shape mismatch for b.weight"):
            load_safetensors_into(shm.path.parent, params)
        assert all(torch.equal(before[k], params[k]) for k in params)
    # a truncated file is refused before anything is read
    save_file({"a.weight": torch.ones(3, 5)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-8])
    with pytest.raises(RequestError, match="inconsistent offsets"):
        load_safetensors_into(tmp_path / "t.safetensors", params)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(RequestError, match="not a safetensors file"):
        load_safetensors_into(tmp_path / "junk.safetensors", params)


def test_buckets_have_one_dtype_and_the_tensor_payload_keeps_it():
    named = [("x", torch.ones(4)), ("y", torch.ones(4)), ("z", torch.ones(4, dtype=torch.bfloat16))]
    buckets = make_buckets(named, 1 << 20)
    assert [[n for n, _ in b] for b in buckets] == [["x", "y"], ["z"]]
    out = deserialize_named_tensors([serialize_named_tensors(buckets[1], flattened=True)], "flattened_bucket")
    assert out[0][1].dtype == torch.bfloat16  # not doubled to float32 on the wire any more
    raw = base64.b64decode(serialize_named_tensors(buckets[1], flattened=True))
    flat = torch.load(io.BytesIO(raw), weights_only=True)["flattened_tensor"]
    assert flat.dtype == torch.bfloat16  # on the wire too: no longer doubled to float32


def test_bad_sync_mode_is_named():
    with pytest.raises(
        ValueError, match="sync.mode must be one of shm, distributed, ipc, tensor, disk; got 'nccl'"
    ):
        WeightSync(["http://127.0.0.1:1"], mode="nccl")


def test_shm_mode_refuses_an_engine_on_another_host():
    with pytest.raises(ValueError, match="sync.mode 'shm' needs every engine on this host.*198.51.100.7"):
        WeightSync(["http://127.0.0.1:1", "http://198.51.100.7:30000"], mode="shm")  # TEST-NET-2: not here


class RecordingEngines:
    """Test double (not an engine): answers the SGLang weight-sync calls of several engine URLs in
    process through httpx.MockTransport and records (engine, path) in arrival order. A pause is
    answered only once all `n` engines' pauses have arrived (a barrier; engines asked one after
    another would time out). `fail_update` names an engine whose update answers 400, `fail_pause`
    one whose pause answers 500."""

    def __init__(self, n: int, fail_update: str | None = None, fail_pause: str | None = None):
        import threading

        self.pauses = threading.Barrier(n)
        self.calls: list[tuple[str, str]] = []
        self.versions: dict[str, str] = {}
        self.fail_update = fail_update
        self.fail_pause = fail_pause
        self._lock = threading.Lock()

    def __call__(self, request):
        import json
        import threading

        import httpx

        engine, path = f"{request.url.scheme}://{request.url.netloc.decode()}", request.url.path
        with self._lock:
            self.calls.append((engine, path))
        if path == "/pause_generation":
            try:
                self.pauses.wait(timeout=10)
            except threading.BrokenBarrierError:
                return httpx.Response(500, text="pauses did not arrive together")
            if engine == self.fail_pause:
                return httpx.Response(500, text="cannot pause")
        if path.startswith("/update_weights"):
            if engine == self.fail_update:
                return httpx.Response(400, json={"success": False, "message": "bad tensor"})
            self.versions[engine] = json.loads(request.content)["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": self.versions.get(engine, "default")})
        return httpx.Response(200, json={"status": "ok"})


def _sync_with(engines: RecordingEngines, tmp_path, n: int = 3) -> WeightSync:
    import httpx

    return WeightSync(
        [f"http://127.0.0.1:{9000 + i}" for i in range(n)],
        mode="disk",
        disk_dir=tmp_path,
        retries=1,
        client=httpx.Client(transport=httpx.MockTransport(engines)),  # instead of the pooled client
    )


def test_each_step_reaches_every_engine_before_the_next_step_starts(tmp_path):
    engines = RecordingEngines(3)
    with _sync_with(engines, tmp_path) as sync:
        report = sync.push(named_mixed(), 7)
    steps = [path for _, path in engines.calls]
    order = ["/pause_generation", "/update_weights_from_disk", "/get_weight_version", "/continue_generation"]
    assert steps == [p for p in order for _ in range(3)]  # no /flush_cache: the update flushed
    assert set(engines.versions.values()) == {"7"}
    assert list(report.phases) == ["stage", "pause", "update", "version", "continue"]
    assert len(report.engine_seconds) == 3 and all(len(s) == 4 for s in report.engine_seconds.values())


def _failed_push(tmp_path, step: str, port: int, version: int) -> list[str]:
    """The engines' calls in a sync where engine 127.0.0.1:`port` fails at `step` (pause, update),
    after checking the error names that engine and step."""
    from palaestra.trainer.weight_sync import WeightSyncError

    engines = RecordingEngines(3, **{f"fail_{step}": f"http://127.0.0.1:{port}"})
    with (
        _sync_with(engines, tmp_path) as sync,
        pytest.raises(WeightSyncError, match=f"127.0.0.1:{port}: {step}"),
    ):
        sync.push(named_mixed(), version)
    return [path for _, path in engines.calls]


def test_a_failed_update_names_the_engine_and_no_engine_continues(tmp_path):
    paths = _failed_push(tmp_path, "update", 9001, 8)
    assert paths.count("/pause_generation") == 3 and paths.count("/update_weights_from_disk") == 3
    assert "/continue_generation" not in paths and "/get_weight_version" not in paths  # left paused


class FailingTransport:
    """Test double (not a transport of the code): its `send` raises, after telling the engines it
    is changing their weights (`touch`) or before doing anything."""

    def __init__(self, engines, touch: bool):
        self.engines, self.touch = engines, touch

    def stage(self, payload, version, clock):
        return payload

    def send(self, staged, version, clock):
        if self.touch:
            self.engines.changing()
        raise OSError("no space left on device")

    def done(self, staged, version, clock):
        raise AssertionError("a failed sync is not done")

    def directory(self, version):
        return None

    def close(self):
        pass


@pytest.mark.parametrize("touch", [False, True])
def test_a_transport_that_fails_before_touching_an_engine_leaves_none_paused(tmp_path, touch):
    engines = RecordingEngines(3)
    with _sync_with(engines, tmp_path) as sync:
        sync.transport = FailingTransport(sync.engines, touch)
        with pytest.raises(OSError, match="no space left"):
            sync.push(named_mixed(), 9)
    paths = [path for _, path in engines.calls]
    assert paths.count("/pause_generation") == 3 and "/get_weight_version" not in paths
    # untouched: every engine holds its old weights and generates again; touched: left paused
    assert paths.count("/continue_generation") == (0 if touch else 3)
    assert paths[-3:] == (["/pause_generation"] * 3 if touch else ["/continue_generation"] * 3)


def test_an_engine_that_does_not_pause_fails_the_sync_and_the_others_stay_paused(tmp_path):
    paths = _failed_push(tmp_path, "pause", 9002, 10)
    assert paths == ["/pause_generation"] * 3  # not resumed with a version the trainer has left behind
