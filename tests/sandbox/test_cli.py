"""`palaestra sandbox exec` as a user runs it: a subprocess, a fresh sandbox per call, uploads,
--json, exit codes per status, and a remote backend given as a URL."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from tests.support.sandbox import exec_server

PALAESTRA = str(Path(sys.executable).with_name("palaestra"))


def sandbox(*args: str, env: dict | None = None, module: bool = True) -> subprocess.CompletedProcess:
    """``python -m palaestra.sandbox`` (quick to import) or the ``palaestra`` entry point."""
    argv = [sys.executable, "-m", "palaestra.sandbox", *args] if module else [PALAESTRA, "sandbox", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_palaestra_sandbox_exec_json(tmp_path):
    done = sandbox("exec", "--json", "--", "python3", "-c", "print(6 * 7)", module=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["status"], result["exit_code"], result["stdout"]) == ("ok", 0, "42\n")


def test_uploads_land_in_the_work_dir(tmp_path):
    (tmp_path / "solution.py").write_text("import helper\nprint(helper.VALUE)\n")
    (tmp_path / "helper.py").write_text("VALUE = 'from helper'\n")
    done = sandbox(
        "exec",
        "--upload",
        str(tmp_path / "solution.py"),
        str(tmp_path / "helper.py"),
        "--",
        "python3",
        "solution.py",
    )
    assert (done.returncode, done.stdout) == (0, "from helper\n"), done.stderr


def test_exit_codes_follow_the_status():
    timeout = sandbox("exec", "--timeout", "1", "--", "sleep", "30")
    assert timeout.returncode == 124 and "[sandbox] timeout" in timeout.stderr
    memory = sandbox("exec", "--memory-mb", "64", "--", "python3", "-c", "x = bytearray(200 << 20)")
    assert memory.returncode == 137 and "[sandbox] memory" in memory.stderr
    failing = sandbox("exec", "--", "sh", "-c", "echo out; echo err >&2; exit 5")
    assert (failing.returncode, failing.stdout, failing.stderr) == (5, "out\n", "err\n")
    missing = sandbox("exec", "--json", "--", "no-such-program")
    assert missing.returncode == 126 and json.loads(missing.stdout)["status"] == "error"


def test_bad_arguments_are_named():
    assert "give the command" in sandbox("exec", "--json").stderr
    assert "--upload nope.txt: no such file" in sandbox("exec", "--upload", "nope.txt", "--", "true").stderr
    assert "--timeout must be positive" in sandbox("exec", "--timeout", "0", "--", "true").stderr


def test_remote_backend_by_url():
    key = secrets.token_hex(8)
    with exec_server(key) as server:
        env = {**os.environ, "PALAESTRA_SANDBOX_API_KEY": key}
        done = sandbox("exec", "--backend", server.url, "--json", "--", "sh", "-c", "echo remote", env=env)
        wrong = sandbox("exec", "--backend", server.url, "--api-key", "wrong", "--", "true")
    assert json.loads(done.stdout)["stdout"] == "remote\n", done.stderr
    assert wrong.returncode == 1 and "refused the API key" in wrong.stderr
    assert "Traceback" not in wrong.stderr
