"""The real Claude Code and Codex CLI binaries, at their pinned versions, drive a session unchanged
(and OpenCode, mini-swe-agent, and our Terminus-style agent, whose turn types keystrokes).

Each harness is pointed at a fresh session's base URL and token the way a user points it at a
vendor (Claude Code: `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY`, streaming Messages; Codex: a
`model_providers` entry with `wire_api = "responses"`, streaming Responses). The engine is
`ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py), so the random-weight `tiny`
model calls the harness's own shell tool on cue, in the template's tool-call syntax: the harness
runs the command, its output reaches the next turn, and that turn's engine prompt extends the
previous prompt + sampled ids exactly (one sample, no fork). The gateway, the Qwen2.5 template,
the tokenizer and both binaries are real. The binaries come from `make install`
(`palaestra harness install`); without one, its test skips saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess

import pytest

from palaestra.environments.harness import configure
from palaestra.environments.harness.install import HARNESSES, binary
from palaestra.gateway.parsers import render_tool_call_text
from tests.environments.test_harness_terminus import terminus_answer
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import new_session, trajectory

pytestmark = pytest.mark.slow

MARK = "PALAESTRA-42"
COMMAND = "echo PALAESTRA-$((6*7))"  # the output (MARK) is in no prompt until the tool has run


class ToolScript:
    """What the scripted engine answers (TEST DOUBLE): on the first call whose prompt renders the
    harness's shell tool, a call of it; once the tool's output is in the prompt, a final text;
    any other call (a harness's side requests: titles, quota checks) a short text."""

    def __init__(self, tok, tool: str, arguments: dict, final: str = f"The command printed {MARK}."):
        self.tok, self.tool, self.arguments, self.final = tok, tool, arguments, final
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[int, str]] = []  # (call index, what was answered)

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if MARK in prompt:
            kind, text = "final", self.final
        elif f'"name": "{self.tool}"' in prompt and not any(k == "tool" for _, k in self.calls):
            kind = "tool"
            text = "Running it.\n" + render_tool_call_text("hermes", self.tool, json.dumps(self.arguments))
        else:
            kind, text = "other", "ok"
        self.calls.append((index, kind))
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


class KeystrokeScript(ToolScript):
    """TEST DOUBLE for terminus, which has no tools: the first call whose prompt shows its answer
    format types COMMAND; once MARK is in a prompt, task_complete (asked to confirm, the same)."""

    def __init__(self, tok, tool: str, arguments: dict):
        super().__init__(tok, tool, arguments, final=terminus_answer([], complete=True))

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if MARK in prompt:
            kind, text = "final", self.final
        elif '"keystrokes"' in prompt and not any(k == "tool" for _, k in self.calls):
            kind, text = "tool", terminus_answer([COMMAND + "\n"])
        else:
            kind, text = "other", "ok"
        self.calls.append((index, kind))
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


@pytest.fixture
def harness_stack(tok, tmp_path):
    """start(tool, arguments[, final=][, script_class=]) -> (gateway, engine, script): a
    `ToolScript` engine behind a gateway."""
    with contextlib.ExitStack() as stack:

        def start(tool: str, arguments: dict, script_class: type[ToolScript] = ToolScript, **final):
            script = script_class(tok, tool, arguments, **final)
            engine = ScriptedEngine(script, stop_ids={script.end})
            eng = stack.enter_context(ThreadServer(engine.app()))
            gw = stack.enter_context(gateway_server(eng.url, tmp_path / "spool", tok))
            return gw, engine, script

        yield start


def _installed(name: str):
    path = binary(name)
    if path is None:
        h = HARNESSES[name]
        pytest.skip(
            f"{h.package}@{h.version} is not installed: run `make install` (palaestra harness install {name})"
        )
    return path


def _offline_env(tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")}
    return {**keep, "HOME": str(home), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def _check_round_trip(gw, engine, script, sid, done, side_conversations: int = 0, streams: bool = True):
    """`streams`: whether the harness streams its turns (mini-swe-agent does not);
    `side_conversations`: how many of the harness's side requests (OpenCode's title) start a
    conversation of their own, which the gateway records as a fork of the session."""
    assert done.returncode == 0, (
        f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    )
    traj = trajectory(gw, sid)
    assert traj["failed_calls"] == [] and traj["refused"] == {}, (traj["failed_calls"], traj["refused"])
    kinds = dict(script.calls)
    tool_at = next((i for i, k in script.calls if k == "tool"), None)
    assert tool_at is not None, (
        f"no call rendered the tool {script.tool!r}; tools: {_tool_names(script, engine)}"
    )
    final_at = next(i for i, k in script.calls if k == "final")
    before, after = engine.exchanges[tool_at], engine.exchanges[final_at]
    assert all(bool(e.body.get("stream")) == streams for e in (before, after)), "streamed or not, as it does"
    sampled = before.answer["output_ids"]
    head = list(before.body["input_ids"]) + list(sampled)
    assert list(after.body["input_ids"][: len(head)]) == head, "the next prompt extends prompt + sampled ids"
    tail = script.tok.decode(after.body["input_ids"][len(head) :])
    assert MARK in tail, tail  # the tool ran, and its output is what the next turn adds
    assert MARK in done.stdout, done.stdout[-2000:]
    turns = {t["call_id"]: t for t in traj["turns"]}
    assert len(turns) == len(kinds), (turns, kinds)
    # the agent's own turns are one sample, bridged; a side conversation is a fork of its own
    assert [f["reason"] for f in traj["forks"]] == ["prefix_changed"] * side_conversations, traj["forks"]
    return traj


def test_claude_code_tool_round_trip(harness_stack, tmp_path):
    claude = _installed("claude-code")
    gw, engine, script = harness_stack("Bash", {"command": COMMAND, "description": "print the number"})
    s = new_session(gw)
    work = tmp_path / "work"
    work.mkdir()
    env = {**_offline_env(tmp_path), **configure.claude_code(s["base_url"], s["api_key"])}
    cmd = [str(claude), "-p", "Run the command and tell me what it printed.", "--model", "tiny"]
    cmd += ["--allowedTools", "Bash", "--max-turns", "4"]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    traj = _check_round_trip(gw, engine, script, s["session_id"], done)
    # what it sends that nothing here acts on is recorded, once per call (gateway/dialects/controls.py)
    ignored = traj["ignored_controls"]
    for name in ("context_management", "anthropic-beta=claude-code-20250219", "metadata"):
        assert ignored.get(name) == len(script.calls), ignored


def test_codex_tool_round_trip(harness_stack, tmp_path):
    codex = _installed("codex")
    gw, engine, script = harness_stack("exec_command", {"cmd": COMMAND})
    s = new_session(gw)
    work = tmp_path / "work"
    work.mkdir()
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    extra, args = configure.codex(s["base_url"], s["api_key"], "tiny")
    env = {**_offline_env(tmp_path), **extra, "CODEX_HOME": str(codex_home)}
    cmd = [str(codex), *args, "Run the command and tell me what it printed."]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    traj = _check_round_trip(gw, engine, script, s["session_id"], done)
    # what it sends that nothing here acts on is recorded, once per call (gateway/dialects/controls.py)
    ignored = traj["ignored_controls"]
    for name in ("client_metadata", "prompt_cache_key", "tools=web_search"):
        assert ignored.get(name) == len(script.calls), ignored


def _tool_names(script, engine) -> list[str]:
    """The tool names rendered into the first engine prompt (for a failure message)."""
    prompt = script.tok.decode(engine.exchanges[0].body["input_ids"])
    return re.findall(r'"name": "([^"]+)"', prompt)


def test_opencode_tool_round_trip(harness_stack, tmp_path):
    opencode = _installed("opencode")
    gw, engine, script = harness_stack("bash", {"command": COMMAND, "description": "print the number"})
    s = new_session(gw)
    work = tmp_path / "work"
    work.mkdir()
    extra, args = configure.opencode(s["base_url"], s["api_key"], "tiny")
    env = {**_offline_env(tmp_path), **extra}
    cmd = [str(opencode), *args, "Run the command and tell me what it printed."]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    traj = _check_round_trip(gw, engine, script, s["session_id"], done, side_conversations=1)
    print(traj["ignored_controls"])


def test_mini_swe_agent_tool_round_trip(harness_stack, tmp_path):
    mini = _installed("mini-swe-agent")
    # it ends by running its finishing command (an answer without a tool call is a format error)
    finish = render_tool_call_text("hermes", "bash", json.dumps({"command": f"echo {configure.MINI_FINISH}"}))
    gw, engine, script = harness_stack("bash", {"command": COMMAND}, final=finish)
    s = new_session(gw)
    work = tmp_path / "work"
    work.mkdir()
    extra, args = configure.mini_swe_agent(s["base_url"], s["api_key"], "tiny")
    env = {**_offline_env(tmp_path), **extra}
    python = mini.parent / "python"
    cmd = [str(python), "-m", "minisweagent", *args, "Run the command and tell me what it printed."]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    traj = _check_round_trip(gw, engine, script, s["session_id"], done, streams=False)
    print(traj["ignored_controls"])


def test_terminus_keystroke_round_trip(harness_stack, tmp_path):
    """Our Terminus-style agent on the host, against the session: its JSON turn types the command
    into its bash, the terminal's output is the next user message, and the next prompt extends the
    previous prompt + sampled ids exactly; it ends after confirming completion."""
    agent = _installed("terminus")  # ours: always installed
    gw, engine, script = harness_stack("keystrokes", {}, script_class=KeystrokeScript)
    s = new_session(gw)
    work = tmp_path / "work"
    work.mkdir()
    extra, args = configure.terminus(s["base_url"], s["api_key"], "tiny", configure.Budget.of(32768))
    env = {**_offline_env(tmp_path), **extra}
    cmd = [configure.PYTHON, "-I", "-S", str(agent), *args, "Run the command and tell me what it printed."]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    traj = _check_round_trip(gw, engine, script, s["session_id"], done, streams=False)
    assert [k for _, k in script.calls] == ["tool", "final", "final"], script.calls  # confirmed once
    assert traj["ignored_controls"] == {}, traj["ignored_controls"]  # model, messages, max_tokens
    assert all(e.body["sampling_params"]["max_new_tokens"] == 4096 for e in engine.exchanges)
