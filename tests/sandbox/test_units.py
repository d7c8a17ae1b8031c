"""Small pieces of the sandbox package, without starting any sandbox: limits, argv and path
checks, the streaming output cap, status precedence, and choosing a backend by name."""

from __future__ import annotations

import pytest

from palaestra.sandbox import CappedOutput, Limits, get_backend
from palaestra.sandbox.base import ExecResult, to_argv, work_path
from palaestra.sandbox.output import build_result


def test_limits_reject_bad_values_naming_the_field():
    assert Limits().memory_mb == 512
    assert Limits().address_space_mb is None and Limits(address_space_mb=4096).address_space_mb == 4096
    bad = (("memory_mb", 0), ("pids", -1), ("cpu_s", 1.5), ("timeout_s", "10"), ("pids", True))
    for field, value in (*bad, ("address_space_mb", 0), ("address_space_mb", 2.5)):
        with pytest.raises(ValueError, match=f"Limits.{field}"):
            Limits(**{field: value})
    with pytest.raises(ValueError, match="memroy_mb"):
        Limits.from_dict({"memroy_mb": 1})
    assert Limits.from_dict(Limits(pids=9).to_dict()) == Limits(pids=9)


def test_argv_and_work_paths():
    assert to_argv(["python3", "-V"], None) == ["python3", "-V"]
    assert to_argv("echo hi", None) == ["/bin/sh", "-c", "echo hi"]
    assert to_argv(None, "echo hi\n") == ["/bin/sh", "-c", "echo hi\n"]
    for cmd, script in ((None, None), (["a"], "b"), ([], None), ([1], None)):
        with pytest.raises(ValueError):
            to_argv(cmd, script)
    with pytest.raises(ValueError, match="'script'"):
        to_argv(None, "x" * 200_000)
    assert work_path("a/./b/../c.txt") == "a/c.txt"
    for bad in ("", "/abs", "..", "../x", "a/../../x", "a\0b"):
        with pytest.raises(ValueError, match="'path'"):
            work_path(bad)


def test_capped_output_keeps_the_head_counts_the_rest_and_says_when_to_kill():
    out = CappedOutput(keep=10, kill_at=25)
    assert not out.feed(b"0123456789ab")
    assert out.data() == b"0123456789" and out.truncated and out.total == 12
    assert not out.feed(b"x" * 13)
    assert out.feed(b"y")  # 26 > 25
    assert out.over and out.data() == b"0123456789"
    split = CappedOutput(keep=2, kill_at=100)
    split.feed("é!".encode())
    assert split.text() == "é" and not split.feed(b"more")
    split_mid = CappedOutput(keep=1, kill_at=100)
    split_mid.feed("é".encode())
    assert split_mid.text() == "\ufffd"


def _result(**kw) -> ExecResult:
    stdout = kw.pop("stdout", CappedOutput(100, 800))
    stderr = kw.pop("stderr", CappedOutput(100, 800))
    return build_result(stdout=stdout, stderr=stderr, duration_s=0.1, timeout_s=2, memory_mb=64, **kw)


def test_status_precedence():
    flood = CappedOutput(1, 2)
    flood.feed(b"xxx")
    memory_stderr = CappedOutput(100, 800)
    memory_stderr.feed(b"Traceback...\nMemoryError\n")
    assert _result(exit_code=None, start_error="nope: not found").status == "error"
    assert _result(exit_code=-9, killed="timeout", stdout=flood).status == "output_limit"
    assert _result(exit_code=-9, killed="timeout", oom_killed=True).status == "memory"
    assert _result(exit_code=-9, killed="timeout").status == "timeout"
    assert _result(exit_code=-24).status == "timeout"  # SIGXCPU
    assert _result(exit_code=1, stderr=memory_stderr).status == "memory"
    assert _result(exit_code=0, stderr=memory_stderr).status == "ok"  # it recovered
    ok = _result(exit_code=3)
    assert (ok.status, ok.exit_code, ok.ok) == ("ok", 3, False)
    assert "file-size" in _result(exit_code=-25).detail
    round_trip = ExecResult.from_dict({**ok.to_dict(), "added_later": 1})
    assert round_trip == ok


def test_get_backend_by_name():
    assert get_backend("local").name == "local"
    assert get_backend("local", label="mine").label == "mine"
    with pytest.raises(ValueError, match="'local', 'docker'"):
        get_backend("kubernetes")
    with pytest.raises(ValueError, match="PALAESTRA_SANDBOX_API_KEY"):
        get_backend("http://127.0.0.1:1")
    remote = get_backend("http://127.0.0.1:1/", api_key="k")
    assert remote.name == "remote" and remote.url == "http://127.0.0.1:1"
