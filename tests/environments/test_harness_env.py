"""The harness environment: the real Claude Code / Codex / OpenCode / mini-swe-agent harnesses and our
Terminus-style agent run on a SWE instance inside a
sandbox whose only way out is their session's tunnel: the local (bubblewrap) backend, and the
docker backend (containers with no network; those cases are marked `docker` and skip, saying why,
where no docker engine answers).

The engine is `ScriptedEngine`, a labelled TEST DOUBLE (tests/support/servers.py): so that the
random `tiny` model's place is taken by an agent that acts on cue, it answers the harness's shell
tool with a call that writes the reference fix (or runs the hostile probe), then a final text (for
terminus: a JSON answer typing the command, then task_complete, twice). The
gateway, the Qwen2.5 template, the tokenizer, the sandbox, the tunnel and both binaries are real;
the episode is graded by swe's hidden tests in a fresh sandbox.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shlex

import httpx
import pytest

from palaestra.environments.harness import configure
from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.harness.install import HARNESSES, binary, install_root, native
from palaestra.environments.swe_agent.snapshot import apply_patch, patch_paths
from palaestra.gateway.parsers import render_tool_call_text
from tests.environments.test_harness_terminus import terminus_answer
from tests.support.sandbox import SANDBOX_BACKENDS, backend_param
from tests.support.servers import ENV_KEY, ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import AUTH, new_session, rollouts, trajectory

pytestmark = pytest.mark.slow

MARK = "PALAESTRA-42"
WRITE = "import base64, sys; open(sys.argv[1], 'wb').write(base64.b64decode(sys.argv[2]))"
SHELL = {
    "claude-code": ("Bash", "command"),
    "codex": ("exec_command", "cmd"),
    "opencode": ("bash", "command"),
    "mini-swe-agent": ("bash", "command"),
    "terminus": ("keystrokes", ""),
}
"""Each harness's shell tool and its command argument (terminus: no tools, its JSON's keystrokes)."""
NEW = ["opencode", "mini-swe-agent", "terminus"]
"""The harnesses added after Claude Code and Codex: the probe and refusal tests run them too."""


def _installed(name: str) -> None:
    if binary(name) is None:
        h = HARNESSES[name]
        pytest.skip(
            f"{h.package}@{h.version} is not installed: run `make install` (palaestra harness install {name})"
        )


@contextlib.contextmanager
def _backend(name: str):
    if name not in SANDBOX_BACKENDS:
        pytest.skip(f"the {name} sandbox backend is not registered here")
    with SANDBOX_BACKENDS[name]() as make:  # docker: skips, saying why, where no engine answers
        yield make()


@pytest.fixture(scope="module")
def local_backend():
    with _backend("local") as backend:
        yield backend


@pytest.fixture(scope="module", params=["local", backend_param("docker")])
def backend(request):
    """Each sandbox backend a harness runs on: local (bubblewrap), docker (marked `docker`)."""
    with _backend(request.param) as backend:
        yield backend


class ShellScript:
    """What the scripted engine answers (TEST DOUBLE): the first call whose prompt renders the
    harness's shell tool gets a call of it running `command`; once MARK is in a prompt, a final
    text; any other call (side requests: titles, quota checks) a short text."""

    def __init__(self, tok, harness: str, command: str):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.tool, self.argument = SHELL[harness]
        self.command = command
        self.calls: list[str] = []
        self.final = "Done."
        self.terminus = harness == "terminus"
        # what shows the agent's shell in its prompt: a tool's schema, or terminus's answer format
        self.cue = '"keystrokes"' if self.terminus else f'"name": "{self.tool}"'
        if harness == "mini-swe-agent":  # it ends by running its finishing command, nothing else
            finish = json.dumps({"command": f"echo {configure.MINI_FINISH}"})
            self.final = render_tool_call_text("hermes", self.tool, finish)
        if self.terminus:  # asked to confirm, it answers the same again
            self.final = terminus_answer([], complete=True)

    def call(self, command: str) -> str:
        """The agent's turn that runs `command` in its shell."""
        if self.terminus:
            return terminus_answer([command + "\n"])
        return render_tool_call_text("hermes", self.tool, json.dumps({self.argument: command}))

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if MARK in prompt:
            kind, text = "final", self.final
        elif self.cue in prompt and "tool" not in self.calls:
            kind, text = "tool", self.call(self.command)
        else:
            kind, text = "other", "ok"
        self.calls.append(kind)
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


@contextlib.contextmanager
def stack(tok, tmp_path, script, **gateway_options):
    # The scripted engine has no context window; told `tiny`'s 32k, Claude Code compacts its ~15k-token
    # prompts at the second call, which a script cannot summarise: the window of a harness's model
    gateway_options.setdefault("context_length", 200_000)
    engine = ScriptedEngine(script, stop_ids={script.end})
    spool = tmp_path / "spool"
    with ThreadServer(engine.app()) as eng, gateway_server(eng.url, spool, tok, **gateway_options) as gw:
        gw.engine_url = eng.url
        yield gw, engine


def _fix_command(instance) -> str:
    """A shell command that writes the reference fix's files, then prints MARK."""
    fixed = apply_patch(instance.base(), instance.patch)
    parts = []
    for path in sorted(patch_paths(instance.patch)):
        data = base64.b64encode(fixed[path]).decode()
        parts.append(f"python3 -c {shlex.quote(WRITE)} {shlex.quote(path)} {data}")
    return " && ".join(parts) + " && echo PALAESTRA-$((6*7))"


@pytest.mark.parametrize("harness", sorted(set(SHELL) - {"terminus"}))
def test_the_sandbox_runs_the_native_binary_not_the_npm_launcher(harness, tmp_path):
    """What a sandbox mounts and runs is the platform package's ELF binary (no node needed; for
    mini-swe-agent its venv's python, a link to the sandbox's); an install without it is refused
    naming the command that reinstalls it."""
    _installed(harness)
    folder, path = native(install_root(harness), harness)
    with open(folder / path, "rb") as f:
        assert f.read(4) == b"\x7fELF", folder / path
    assert "node_modules/.bin" not in str(folder)
    with pytest.raises(RuntimeError, match=f"palaestra harness install {harness}@"):
        native(tmp_path / f"{harness}@0.0.0", harness)


@pytest.mark.parametrize("harness", sorted(SHELL))
def test_harness_fixes_the_instance_in_the_sandbox(tok, tmp_path, backend, swe_data, harness):
    _installed(harness)
    env = HarnessEnv(harness=harness, data=str(swe_data), backend=backend, max_turns=8, time_limit_s=300)
    instance = next(i for i in env.tasks(0) if i.bug_kind != "missing_case")
    script = ShellScript(tok, harness, _fix_command(instance))
    with stack(tok, tmp_path, script) as (gw, engine):
        result = rollouts(gw.url, ENV_KEY, env, [instance]).results[0]
        assert result.status == "completed", result.error
        traj = httpx.get(f"{gw.url}/sessions/{result.session_id}", headers=AUTH).json()
    metrics = result.metrics
    last = tok.decode(engine.exchanges[-1].body["input_ids"])[-1500:] if engine.exchanges else ""
    assert "tool" in script.calls and "final" in script.calls, (script.calls, last)
    assert traj["refused"] == {} and traj["failed_calls"] == [], (traj["refused"], traj["failed_calls"])
    assert metrics["failure/harness_exit"] == 0 and metrics["failure/harness_timeout"] == 0, metrics
    assert metrics["harness/calls"] == len(script.calls) and metrics["tunnel/refused"] == 0, metrics
    assert metrics["resolved"] == 1.0 and result.reward == 1.0, metrics  # the fix reached grading


PROBE = r"""
import base64, json, os, re, socket, sys, urllib.error, urllib.request
other, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
seen, pid = [f"{k}={v}" for k, v in os.environ.items()], os.getppid()
while pid > 1:  # the harness's own URL and token, wherever it keeps them: its processes' env and argv
    for name in ("environ", "cmdline"):
        try:
            seen.append(open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace"))
        except OSError:  # a process that is not dumpable
            pass
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
text = "\0".join(seen)
own = re.search(r"/s/([0-9a-f]{32})", text).group(1)  # its base URL: .../s/<own id>[/v1]
names = ("ANTHROPIC_API_KEY", "PALAESTRA_SESSION_KEY", "OPENAI_API_KEY")
token = next(v for k, _, v in (e.partition("=") for e in text.split("\0")) if k in names)
out = {"tcp": {}, "http": {}}
for port in ports:  # the host's loopback servers (gateway, engine): not in this network namespace
    s = socket.socket()
    s.settimeout(3)
    out["tcp"][str(port)] = s.connect_ex(("127.0.0.1", port))
s = socket.socket()
s.settimeout(3)
out["tcp"]["10.0.0.1:80"] = s.connect_ex(("10.0.0.1", 80))
paths = [("GET", f"/s/{other}/v1/models"), ("POST", f"/s/{other}/v1/chat/completions"),
         ("GET", "/sessions"), ("GET", f"/sessions/{own}"), ("POST", f"/sessions/{own}/reward"),
         ("GET", "/metrics"), ("GET", "/admin/pause"), ("GET", f"/s/{own}/v1/../../../sessions/{own}"),
         ("POST", f"/s/{own}/v1/%2e%2e/%2e%2e/%2e%2e/sessions/{own}/reward"), ("GET", f"/s/{own}/v1/models")]
for method, path in paths:
    req = urllib.request.Request("http://127.0.0.1:8080" + path, method=method,
                                 data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        out["http"][method + " " + path] = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        out["http"][method + " " + path] = exc.code
print("PROBE" + base64.b64encode(json.dumps(out).encode()).decode() + "END")  # quoted as-is in any tool result
"""


class LoopScript(ShellScript):
    """TEST DOUBLE: every call that renders the shell tool is answered with a call of it (the probe
    first, then `echo again`): an agent that never stops, for the turn budget to end."""

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if self.cue not in prompt:
            self.calls.append("other")
            return self.tok.encode("ok", add_special_tokens=False) + [self.end]
        command = self.command if "tool" not in self.calls else "echo again"
        self.calls.append("tool")
        text = self.call(command)
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


@pytest.mark.parametrize("harness", ["claude-code", *NEW])
def test_harness_sandbox_reaches_only_its_own_session_and_its_turn_budget_ends_it(
    tok, tmp_path, backend, swe_data, harness
):
    """From inside the sandbox, by the harness's own shell tool: the host's loopback ports and any
    other address are unreachable; through the tunnel, another session's routes, the session and
    admin API and every spelling that climbs out of its own prefix are 403 and counted; its own
    route is reached. Then the agent loops, and the turn budget (3 model calls) stops it."""
    _installed(harness)
    if harness in NEW and "docker" in type(backend).__name__.lower():
        pytest.skip(
            "a container's isolation is the backend's, probed here with Claude Code; each new harness "
            "runs in a container in test_harness_fixes_the_instance_in_the_sandbox (CI time)"
        )
    env = HarnessEnv(harness=harness, data=str(swe_data), backend=backend, max_turns=3)
    instance = env.tasks(0)[0]
    script = LoopScript(tok, harness, "")
    with stack(tok, tmp_path, script) as (gw, engine):
        other = new_session(gw)
        ports = [url.rsplit(":", 1)[1] for url in (gw.url, gw.engine_url)]
        script.command = f"python3 -c {shlex.quote(PROBE)} {other['session_id']} {' '.join(ports)}"
        result = rollouts(gw.url, ENV_KEY, env, [instance]).results[0]
        assert result.status == "completed", result.error
        other_after = trajectory(gw, other["session_id"])
    metrics = result.metrics
    prompts = [tok.decode(e.body["input_ids"]) for e in engine.exchanges]
    found = re.findall(r"PROBE([A-Za-z0-9+/=]+)END", "".join(prompts))
    assert found, f"the probe's output reached no prompt; calls: {script.calls}; {prompts[-1][-1500:]}"
    probe = json.loads(base64.b64decode(found[0]))
    assert all(code != 0 for code in probe["tcp"].values()), probe["tcp"]  # nothing connects
    own_route = next(k for k in probe["http"] if k.endswith("/v1/models") and other["session_id"] not in k)
    refused = {k: v for k, v in probe["http"].items() if k != own_route}
    assert set(refused.values()) == {403}, probe["http"]
    assert probe["http"][own_route] != 403, probe["http"]  # its own session's route goes through
    assert metrics["tunnel/refused"] == len(refused), metrics
    assert other_after["turns"] == [], "nothing reached the other session"
    # the budget: 3 calls forwarded, the 4th refused, the harness stopped, the episode still graded
    assert metrics["harness/calls"] == 3 and metrics["tunnel/over_budget"] >= 1, metrics
    assert metrics["failure/harness_timeout"] == 1 and metrics["failure/harness_exit"] == 0, metrics
    assert metrics["resolved"] == 0.0 and "patch_applies" in metrics, metrics


REFUSE = {
    "claude-code": ({"max_tokens_over_context": "reject", "context_length": 32_768}, ":max_tokens"),
    "opencode": ({"max_tokens_over_context": "reject", "context_length": 16_384}, ":max_tokens"),
    "mini-swe-agent": ({"context_length": 1024}, ":messages"),
    "terminus": ({"max_tokens_over_context": "reject", "context_length": 32_768}, ":max_tokens"),
}
"""How the gateway is set to refuse each harness's first request, and the field it names: Claude
Code's `max_tokens` (told an output budget of 30,000 in a 32k window: `REFUSE_BUDGET`) and
OpenCode's (16,000 in a 16k window: both its requests, the task's ~15,000-token prompt and its
title request's ~1,100, run in parallel, are refused naming max_tokens, whichever comes first) do
not fit the context beside the prompt (with `max_tokens_over_context: reject`); mini-swe-agent
sends no max_tokens, so its first prompt is made longer than the context; terminus is told an
output budget of 32,700 tokens in a 32k window, which no prompt leaves room for."""
REFUSE_BUDGET = {"claude-code": 30_000, "opencode": 16_000, "terminus": 32_700}


@pytest.mark.parametrize("harness", sorted(REFUSE))
def test_a_refused_request_ends_the_harness_non_zero_and_names_the_field(
    tok, tmp_path, local_backend, swe_data, harness
):
    """The gateway refuses the harness's first request (a 400 naming the field, recorded in the
    session), the harness exits non-zero, and the episode records `failure/harness_exit` with the
    exit status and is still graded."""
    _installed(harness)
    options, field = REFUSE[harness]
    env = HarnessEnv(
        harness=harness,
        data=str(swe_data),
        backend=local_backend,
        max_turns=4,
        max_output_tokens=REFUSE_BUDGET.get(harness),
    )
    script = ShellScript(tok, harness, "echo unused")
    with stack(tok, tmp_path, script, **options) as (gw, engine):
        result = rollouts(gw.url, ENV_KEY, env, [env.tasks(0)[0]]).results[0]
        assert result.status == "completed", result.error
        traj = trajectory(gw, result.session_id)
    metrics = result.metrics
    assert script.calls == [] and engine.exchanges == [], "nothing reached the engine"
    assert any(key.endswith(field) for key in traj["refused"]), traj["refused"]
    assert metrics["failure/harness_exit"] == 1 and metrics["harness/exit_code"] not in (0, -1), metrics
    assert metrics["failure/harness_timeout"] == 0 and metrics["resolved"] == 0.0, metrics
