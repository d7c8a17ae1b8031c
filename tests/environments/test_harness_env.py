"""The harness environment: the real Claude Code / Codex binaries run on a SWE instance inside the
local (bubblewrap) sandbox, whose only way out is their session's tunnel.

The engine is `ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py): so that the
random `tiny` model's place is taken by an agent that acts on cue, it answers the harness's shell
tool with a call that writes the reference fix (or runs the hostile probe), then a final text. The
gateway, the Qwen2.5 template, the tokenizer, the sandbox, the tunnel and both binaries are real;
the episode is graded by swe's hidden tests in a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shlex

import httpx
import pytest

from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.harness.install import HARNESSES, binary
from palaestra.environments.swe_agent.generate import generate
from palaestra.environments.swe_agent.snapshot import apply_patch, patch_paths
from palaestra.gateway.parsers import render_tool_call_text
from tests.support.doubles import SubprocessBackendForTests
from tests.support.sandbox import SANDBOX_BACKENDS
from tests.support.servers import ENV_KEY, ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import AUTH, rollouts

pytestmark = pytest.mark.slow

MARK = "PALAESTRA-42"
WRITE = "import base64, sys; open(sys.argv[1], 'wb').write(base64.b64decode(sys.argv[2]))"
SHELL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd")}
"""Each harness's shell tool and its command argument."""


def _installed(name: str) -> None:
    if binary(name) is None:
        h = HARNESSES[name]
        pytest.skip(
            f"{h.package}@{h.version} is not installed: run `make install` (palaestra harness install {name})"
        )


@pytest.fixture(scope="module")
def local_backend():
    if "local" not in SANDBOX_BACKENDS:
        pytest.skip("the local (bubblewrap) sandbox backend is not registered here")
    with SANDBOX_BACKENDS["local"]() as make:
        yield make()


@pytest.fixture(scope="module")
def swe_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("swe") / "swe.jsonl"
    instances = asyncio.run(
        generate(out, SubprocessBackendForTests(), per_kind=1, repos=["textkit"], tries_per_kind=4)
    )
    assert instances, "no instance generated"
    return out


class ShellScript:
    """What the scripted engine answers (TEST DOUBLE): the first call whose prompt renders the
    harness's shell tool gets a call of it running `command`; once MARK is in a prompt, a final
    text; any other call (side requests: titles, quota checks) a short text."""

    def __init__(self, tok, harness: str, command: str):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.tool, self.argument = SHELL[harness]
        self.command = command
        self.calls: list[str] = []

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if MARK in prompt:
            kind, text = "final", "Done."
        elif f'"name": "{self.tool}"' in prompt and "tool" not in self.calls:
            kind = "tool"
            text = render_tool_call_text("hermes", self.tool, json.dumps({self.argument: self.command}))
        else:
            kind, text = "other", "ok"
        self.calls.append(kind)
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


@contextlib.contextmanager
def stack(tok, tmp_path, script):
    engine = ScriptedEngine(script, stop_ids={script.end})
    with ThreadServer(engine.app()) as eng, gateway_server(eng.url, tmp_path / "spool", tok) as gw:
        yield gw, engine


def _fix_command(instance) -> str:
    """A shell command that writes the reference fix's files, then prints MARK."""
    fixed = apply_patch(instance.base(), instance.patch)
    parts = []
    for path in sorted(patch_paths(instance.patch)):
        data = base64.b64encode(fixed[path]).decode()
        parts.append(f"python3 -c {shlex.quote(WRITE)} {shlex.quote(path)} {data}")
    return " && ".join(parts) + " && echo PALAESTRA-$((6*7))"


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
def test_harness_fixes_the_instance_in_the_sandbox(tok, tmp_path, local_backend, swe_data, harness):
    _installed(harness)
    env = HarnessEnv(
        harness=harness, data=str(swe_data), backend=local_backend, max_turns=8, time_limit_s=300
    )
    instance = next(i for i in env.tasks(0) if i.bug_kind != "missing_case")
    script = ShellScript(tok, harness, _fix_command(instance))
    with stack(tok, tmp_path, script) as (gw, engine):
        result = rollouts(gw.url, ENV_KEY, env, [instance]).results[0]
        assert result.status == "completed", result.error
        traj = httpx.get(f"{gw.url}/sessions/{result.session_id}", headers=AUTH).json()
    metrics = result.metrics
    assert "tool" in script.calls and "final" in script.calls, script.calls
    assert traj["refused"] == {} and traj["failed_calls"] == [], (traj["refused"], traj["failed_calls"])
    assert metrics["failure/harness_exit"] == 0 and metrics["failure/harness_timeout"] == 0, metrics
    assert metrics["harness/calls"] == len(script.calls) and metrics["tunnel/refused"] == 0, metrics
    assert metrics["resolved"] == 1.0 and result.reward == 1.0, metrics  # the fix reached grading
