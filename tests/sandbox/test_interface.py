"""The sandbox interface (sandbox/base.py), the same on every backend in tests/support/sandbox.py:
exec forms and statuses, stdin, upload/download, a work dir that persists across execs, reset,
close, and the file operations' refusal to follow what a command planted."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from palaestra.sandbox import Limits, SandboxError

LIMITS = Limits(timeout_s=10, memory_mb=256, output_bytes=4096)


@pytest.fixture(scope="module")
def box(sandbox_backend, loop_runner):
    backend = sandbox_backend.make()
    sandbox = loop_runner.run(backend.create("python", LIMITS))
    yield sandbox
    loop_runner.run(sandbox.close())
    loop_runner.run(backend.close())


def test_exec_forms_exit_codes_and_streams(box, loop_runner):
    async def go():
        return (
            await box.exec(
                ["python3", "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"]
            ),
            await box.exec("echo $((6 * 7))"),
            await box.exec(script="set -e\nx=hello\necho $x world\n"),
            await box.exec(["cat"], stdin=b"\x00binary\xff"),
            await box.exec(["wc", "-c"], stdin="é" * 10),
            await box.exec(["sh", "-c", "kill -TERM $$"]),
            await box.exec(["no-such-program"]),
            await box.exec(["pwd"]),
        )

    code, shell, script, binary, text, signalled, missing, pwd = loop_runner.run(go())
    assert (code.status, code.exit_code, code.stdout, code.stderr) == ("ok", 3, "out\n", "err\n")
    assert shell.ok and shell.stdout == "42\n"
    assert script.ok and script.stdout == "hello world\n"
    assert binary.stdout == "\x00binary\ufffd"  # undecodable bytes are replaced, not dropped
    assert text.stdout.strip() == "20"
    assert signalled.status == "ok" and signalled.exit_code == -15
    assert missing.status == "error" and missing.exit_code is None and "no-such-program" in missing.detail
    assert pwd.stdout == "/work\n"
    assert code.duration_s > 0 and code.enforced


def test_output_is_capped_with_a_truncated_flag(box, loop_runner):
    result = loop_runner.run(box.exec(["sh", "-c", "head -c 10000 /dev/zero | tr '\\0' a; echo done >&2"]))
    assert result.status == "ok"
    assert result.stdout == "a" * LIMITS.output_bytes and result.stdout_truncated
    assert result.stderr == "done\n" and not result.stderr_truncated


def test_upload_download_and_a_persistent_work_dir(box, loop_runner):
    blob = bytes(range(256)) * 1000

    async def go():
        await box.upload("data/blob.bin", blob)
        await box.upload("hello.py", "print(open('data/blob.bin', 'rb').read()[:3])")
        await box.exec(["sh", "-c", "echo kept > made-by-exec.txt"])
        run = await box.exec(["python3", "hello.py"])
        return run, await box.download("data/blob.bin"), await box.download("made-by-exec.txt")

    run, back, made = loop_runner.run(go())
    assert run.stdout == "b'\\x00\\x01\\x02'\n"
    assert back == blob
    assert made == b"kept\n"


def test_file_errors_name_the_problem(box, loop_runner):
    with pytest.raises(FileNotFoundError):
        loop_runner.run(box.download("never-written.txt"))
    for bad in ("/etc/passwd", "../outside", "a/../../b", ""):
        with pytest.raises(ValueError, match="'path'"):
            loop_runner.run(box.upload(bad, b"x"))
    with pytest.raises(ValueError, match="'timeout'"):
        loop_runner.run(box.exec(["true"], timeout=-1))
    with pytest.raises(ValueError, match="exactly one"):
        loop_runner.run(box.exec(["true"], script="true"))


def test_file_operations_do_not_follow_planted_links_or_block_on_fifos(box, loop_runner):
    """A command plants a symlink (to the agent's own memory, to a host-looking path) and a FIFO;
    upload and download must neither follow nor hang, and the sandbox stays usable."""

    async def go():
        planted = await box.exec(
            [
                "sh",
                "-c",
                "ln -sf /proc/self/mem mem; ln -sf /etc link; mkfifo fifo; ln -sfn /usr dir; echo ok",
            ]
        )
        outcomes = []
        for op in (
            lambda: box.upload("mem", b"overwrite"),
            lambda: box.download("mem"),
            lambda: box.upload("link/evil", b"x"),
            lambda: box.upload("dir/evil", b"x"),
            lambda: asyncio.wait_for(box.download("fifo"), 10),
            lambda: asyncio.wait_for(box.upload("fifo", b"x"), 10),
        ):
            try:
                await op()
                outcomes.append("done")
            except (OSError, SandboxError) as exc:
                outcomes.append(type(exc).__name__)
        after = await box.exec(["echo", "still alive"])
        await box.exec(["rm", "-f", "mem", "link", "fifo", "dir"])
        return planted, outcomes, after

    planted, outcomes, after = loop_runner.run(go())
    assert planted.stdout == "ok\n", planted
    assert "done" not in outcomes, outcomes
    assert "TimeoutError" not in outcomes, outcomes
    assert after.ok and after.stdout == "still alive\n"


def test_reset_empties_work_and_tmp(box, loop_runner):
    async def go():
        await box.exec(["sh", "-c", "mkdir -p d/e && touch d/e/f .hidden /tmp/t && chmod 000 d"])
        await box.reset()
        return await box.exec(["sh", "-c", "ls -A /work /tmp | grep -v : | grep . | wc -l"])

    assert loop_runner.run(go()).stdout == "0\n"


# Each exec reports when its sleep began and ended by the host's clock (the sandboxes share it), so
# the check is whether the two sleeps overlapped, not how long the calls took: a loaded machine that
# is slow to start a process cannot make queued execs overlap, and only a start skew longer than the
# sleep could keep parallel ones apart.
_TIMED_SLEEP = ["python3", "-c", "import time; a = time.time(); time.sleep(1.5); print(a, time.time())"]


def _overlap(first, second) -> bool:
    (a0, a1), (b0, b1) = (map(float, r.stdout.split()) for r in (first, second))
    return max(a0, b0) < min(a1, b1)


def test_execs_in_one_sandbox_queue_and_sandboxes_run_in_parallel(sandbox_backend, box, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        other = await backend.create("python", LIMITS)
        try:
            parallel = await asyncio.gather(box.exec(_TIMED_SLEEP), other.exec(_TIMED_SLEEP))
            queued = await asyncio.gather(box.exec(_TIMED_SLEEP), box.exec(_TIMED_SLEEP))
        finally:
            await other.close()
            await backend.close()
        return parallel, queued

    parallel, queued = loop_runner.run(go())
    assert all(r.ok for r in (*parallel, *queued)), [r.detail or r.stderr for r in (*parallel, *queued)]
    assert _overlap(*parallel), [r.stdout for r in parallel]
    assert not _overlap(*queued), [r.stdout for r in queued]


def test_closed_sandbox_is_dead_and_refuses_work(sandbox_backend, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        sandbox = await backend.create("python", LIMITS)
        alive_before = await sandbox.alive()
        await sandbox.close()
        await sandbox.close()  # idempotent
        alive_after = await sandbox.alive()
        try:
            await sandbox.exec(["true"])
        except SandboxError as exc:
            refused = str(exc)
        else:
            refused = ""
        await backend.close()
        return alive_before, alive_after, refused

    alive_before, alive_after, refused = loop_runner.run(go())
    assert alive_before and not alive_after
    assert "closed" in refused


def test_unknown_profile_is_an_error_naming_it(sandbox_backend, loop_runner):
    async def go():
        backend = sandbox_backend.make()
        try:
            await backend.create("cobol", LIMITS)
        finally:
            await backend.close()

    with pytest.raises(ValueError, match="cobol"):
        loop_runner.run(go())


def test_a_cancelled_exec_never_answers_the_next_one(sandbox_backend, loop_runner):
    """A caller may cancel an exec (asyncio.wait_for). The sandbox must then either be dead or
    answer the next exec with that exec's own result, never the cancelled one's."""

    async def go():
        backend = sandbox_backend.make()
        sandbox = await backend.create("python", LIMITS)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sandbox.exec(["sh", "-c", "sleep 1; echo stale"]), 0.3)
            alive = await sandbox.alive()
            after = await sandbox.exec(["echo", "fresh"]) if alive else None
        finally:
            await sandbox.close()
            await backend.close()
        return alive, after

    alive, after = loop_runner.run(go())
    assert not alive or (after.ok and after.stdout == "fresh\n"), after


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs bwrap as another user (uid 65534)")
def test_a_bwrap_the_sandbox_user_cannot_reach_is_named_and_auto_falls_back(loop_runner):
    """Started by root, bwrap runs as uid 65534: a checkout in a directory closed to other users
    (under /root, or `mktemp -d`) made every local sandbox fail with a bare PermissionError. The
    error names the closed directory and what to change; `auto` goes on in root-userns mode. (By
    default the backend runs a readable stand-in of such a bwrap instead: `share`, tested in
    tests/environments/test_swe_repo_env.py; here it is off.)"""
    from palaestra.sandbox import LocalBackend
    from palaestra.sandbox.bwrap import find_bwrap
    from tests.support.sandbox import TEST_LABEL

    closed = Path(tempfile.mkdtemp(prefix="palaestra-closed-"))  # mode 700, in /tmp (open to all)
    try:
        (closed / "bwrap").symlink_to(find_bwrap())
        strict = LocalBackend(bwrap=str(closed / "bwrap"), mode="unprivileged", label=TEST_LABEL, share=False)
        with pytest.raises(SandboxError) as err:
            loop_runner.run(strict.create("python", LIMITS))
        message = str(err.value)
        assert f"{closed} (mode 700) is closed to other users" in message, message
        assert "chmod o+x" in message and "PALAESTRA_BWRAP" in message

        auto = LocalBackend(bwrap=str(closed / "bwrap"), mode="auto", label=TEST_LABEL, share=False)

        async def go():
            box = await auto.create("python", LIMITS)
            try:
                return await box.exec("echo fell back"), box.enforced
            finally:
                await box.close()
                await auto.close()

        result, enforced = loop_runner.run(go())
    finally:
        shutil.rmtree(closed, ignore_errors=True)
    assert result.stdout == "fell back\n", result
    assert "user namespace mapped to host root" in enforced and "closed to other users" in enforced


def test_the_local_backend_puts_the_address_space_limit_apart_from_the_memory(loop_runner):
    """RLIMIT_AS is `memory_mb` unless `address_space_mb` says otherwise (a runtime that reserves
    GiBs it never touches: OpenCode's), and an allocation past it is reported at that limit."""
    from palaestra.sandbox import LocalBackend
    from tests.support.sandbox import TEST_LABEL

    backend = LocalBackend(label=TEST_LABEL)
    grab = "import sys; b = bytearray(int(sys.argv[1]) << 20)"

    async def go(limits):
        box = await backend.create("python", limits)
        try:
            limit = await box.exec(["sh", "-c", "grep 'Max address space' /proc/self/limits"])
            return limit.stdout.split()[3], await box.exec(["python3", "-c", grab, "1024"])
        finally:
            await box.close()

    try:
        assert loop_runner.run(go(LIMITS))[0] == str(256 << 20)
        wide = dataclasses.replace(LIMITS, address_space_mb=768)
        limit, over = loop_runner.run(go(wide))
    finally:
        loop_runner.run(backend.close())
    assert limit == str(768 << 20)
    assert over.status == "memory" and "768 MiB address-space limit" in over.detail, over
