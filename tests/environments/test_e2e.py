"""code_sandbox and swe_agent end to end through the gateway: scripted agents (a labelled
SCRIPTED ENGINE — a test double that answers /generate with the token ids of texts the test chose)
that are right, wrong, or write malformed tool calls get the right rewards and failure counts, with
the tool round trips in the samples and tool results masked 0; then the tiny model (the real
embedded engine) runs a few real episodes of each without errors. Sandboxes: the labelled
subprocess test double and, where it can run, the local bubblewrap backend."""

from __future__ import annotations

import json

import httpx
import pytest

from palaestra.environments.code_sandbox.env import CodeSandboxEnv
from palaestra.environments.swe_agent.env import SweAgentEnv
from palaestra.environments.swe_agent.snapshot import apply_patch, patch_paths
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.sdk.runner import take_tasks
from tests.support.doubles import SubprocessBackendForTests
from tests.support.sandbox_backends import backend_for, backend_names
from tests.support.servers import ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import rollouts

KEY = {"Authorization": "Bearer k-env"}


class Scripted:
    """A scripted engine + gateway; `play(replies)` makes the next calls answer with those texts."""

    def __init__(self, tok, tmp_path):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.replies: list[str] = []
        self.start = 0
        self.engine = ScriptedEngine(self._script, stop_ids={self.end})
        self.tmp_path = tmp_path

    def _script(self, ids, index):
        k = index - self.start
        text = self.replies[k] if k < len(self.replies) else "I give up."
        return self.tok.encode(text, add_special_tokens=False) + [self.end]

    def __enter__(self):
        self.eng = ThreadServer(self.engine.app()).__enter__()
        self.gw = gateway_server(self.eng.url, self.tmp_path, self.tok, api_key="k-env").__enter__()
        return self

    def __exit__(self, *exc):
        self.gw.__exit__(*exc)
        self.eng.__exit__(*exc)

    def play(self, env, task, replies):
        self.replies, self.start = replies, len(self.engine.exchanges)

        result = rollouts(self.gw.url, "k-env", env, [task]).results[0]
        assert result.status == "completed", result.error
        session = httpx.get(f"{self.gw.url}/sessions/{result.session_id}", headers=KEY).json()
        samples = [
            s
            for s in httpx.get(f"{self.gw.url}/samples", params={"limit": 1000}, headers=KEY).json()[
                "samples"
            ]
            if s["session_id"] == result.session_id
        ]
        return result, session, samples

    def split(self, sample):
        response = sample["tokens"][sample["prompt_len"] :]
        pairs = list(zip(response, sample["loss_mask"], strict=True))
        return (
            self.tok.decode([t for t, m in pairs if m == 0]),
            self.tok.decode([t for t, m in pairs if m == 1]),
        )


def call(name, **arguments):
    return render_tool_call_text("hermes", name, json.dumps(arguments))


@pytest.fixture(params=backend_names())
def backend(request):
    with backend_for(request.param) as b:
        yield b


# ------------------------------------------------------------------------------------ code_sandbox


def test_code_env_scripted_agents(tok, tmp_path, backend):
    env = CodeSandboxEnv(difficulty=0, backend=backend, max_turns=4)
    task = take_tasks(env, 1, seed=3)[0]
    wrong = task.reference.replace("return ", "return 1 + ")
    with Scripted(tok, tmp_path) as s:
        right, session, samples = s.play(
            env,
            task,
            [
                call("run_python", code=task.reference + "\nprint('probe', 40 + 2)\n"),
                f"Here it is:\n```python\n{task.reference}```",
            ],
        )
        assert right.reward == 1.0 and right.metrics["correct"] == 1.0
        assert right.metrics["tool_calls"] == 1.0 and right.metrics["failure/tool_call_parse"] == 0.0
        assert session["metrics"]["correct"] == 1.0  # the episode's record, visible in GET /sessions/{id}
        (sample,) = samples
        masked, sampled = s.split(sample)
        assert "probe 42" in masked and "exit code 0" in masked  # the sandbox's output: environment tokens
        assert "probe 42" not in sampled.replace("print('probe', 40 + 2)", "")
        assert "<tool_call>" in sampled and "```python" in sampled
        assert sum(sample["loss_mask"]) == sum(len(ex.answer["output_ids"]) for ex in s.engine.exchanges[-2:])
        assert sample["metrics"]["failure/tool_call_parse"] == 0.0

        bad, _, _ = s.play(env, task, [f"```python\n{wrong}```"])
        assert bad.reward == 0.0 and bad.metrics["correct"] == 0.0

        # A malformed call (not JSON) and a call with a missing argument: errors back, episode goes on.
        messy, _, samples = s.play(
            env,
            task,
            [
                '<tool_call>\n{"name": "run_python", "arguments": {"code": \n</tool_call>',
                call("run_python", program="print(1)"),
                f"```python\n{task.reference}```",
            ],
        )
        assert messy.reward == 1.0 and messy.metrics["failure/tool_call_parse"] == 2.0
        masked, _ = s.split(samples[-1])
        assert "missing string argument 'code'" in masked

        # A program that hangs: the sandbox timeout is named.
        slow = CodeSandboxEnv(difficulty=0, backend=backend, tool_timeout_s=1.0)
        hung, _, _ = s.play(slow, task, [call("run_python", code="while True: pass"), "no answer"])
        assert hung.metrics["failure/sandbox_timeout"] == 1.0 and hung.metrics["failure/no_answer"] == 1.0


# ------------------------------------------------------------------------------------ swe_agent


def _fix_calls(instance):
    """The tool calls that apply the reference fix with str_replace (one per changed hunk)."""
    base = instance.base()
    fixed = apply_patch(base, instance.patch)
    calls = []
    for path in sorted(patch_paths(instance.patch)):
        before, after = base[path].decode().splitlines(True), fixed[path].decode().splitlines(True)
        changed = [i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b]
        i = changed[0]
        old = "".join(before[max(i - 1, 0) : i + 2])
        new = "".join(after[max(i - 1, 0) : i + 2 + len(after) - len(before)])
        calls.append(call("str_replace", path=path, old_str=old, new_str=new))
    return calls, sorted(patch_paths(instance.patch))[0]


def test_swe_env_scripted_agents(tok, tmp_path, backend, swe_data):
    env = SweAgentEnv(data=str(swe_data), backend=backend, max_turns=8)
    instance = next(i for i in env.tasks(0) if i.bug_kind != "missing_case")  # a one-line fix
    fix, path = _fix_calls(instance)
    with Scripted(tok, tmp_path) as s:
        right, session, samples = s.play(
            env,
            instance,
            [
                call("read_file", path=path),
                *fix,
                call("bash", command="python3 -m unittest 2>&1 | tail -1; git log --oneline | wc -l"),
                call("submit"),
            ],
        )
        assert right.reward == 1.0, right.metrics
        assert right.metrics["resolved"] == 1.0 and right.metrics["submitted"] == 1.0
        assert (
            right.metrics["tool_calls"] == 3.0 + len(fix) and right.metrics["failure/tool_call_parse"] == 0.0
        )
        assert session["metrics"]["resolved"] == 1.0
        (sample,) = samples
        masked, sampled = s.split(sample)
        assert "edited " + path in masked and "OK" in masked  # the visible tests pass after the fix
        assert "\n1\n" in masked  # the agent's copy has one commit: the buggy snapshot
        assert '"name": "str_replace"' in sampled and "edited " + path not in sampled

        wrong, _, _ = s.play(env, instance, [call("submit")])
        assert wrong.reward == 0.0 and wrong.metrics["resolved"] == 0.0

        messy, _, samples = s.play(
            env,
            instance,
            [
                call("read_file", path="../../etc/passwd"),
                call("delete_everything"),
                '<tool_call>\n{"name": "bash", "arguments": \n</tool_call>',
                *fix,
                call("submit"),
            ],
        )
        assert messy.reward == 1.0 and messy.metrics["failure/tool_call_parse"] == 3.0
        masked, _ = s.split(samples[-1])
        assert (
            "must be relative to the repository root" in masked
            and "unknown tool 'delete_everything'" in masked
        )


# ------------------------------------------------------------------------------------ tiny model


@pytest.mark.slow
@pytest.mark.engine
def test_tiny_model_runs_real_episodes(engine, tmp_path, swe_data):
    """The real embedded engine with the tiny (random-weight) model: episodes finish, nothing fails."""
    double = SubprocessBackendForTests()
    envs = [
        CodeSandboxEnv(difficulty=0, backend=double, max_turns=2, max_tokens=32),
        SweAgentEnv(data=str(swe_data), backend=double, max_turns=2, max_tokens=32),
    ]
    with gateway_server(engine.url, tmp_path, api_key="k-env") as gw:
        for env in envs:
            summary = rollouts(gw.url, "k-env", env, take_tasks(env, 2, seed=0), concurrency=2)
            assert summary.statuses.get("failed", 0) == 0, [r.error for r in summary.results]
            for result in summary.results:
                assert "time/model_s" in result.metrics and result.metrics["time/model_s"] > 0


@pytest.mark.slow
def test_rollout_and_eval_cli_run_both_environments(tok, tmp_path, swe_data):
    """`palaestra rollout` / `palaestra eval` load the environments by name; the scripted engine's
    agent gives up at once, so every episode completes with reward 0 and names what went wrong."""
    import os
    import subprocess
    import sys

    double = "tests.support.doubles:SubprocessBackendForTests"
    with Scripted(tok, tmp_path) as s:
        for env, args in (
            ("code", {"backend": double, "max_turns": 1}),
            ("swe", {"backend": double, "max_turns": 1, "data": str(swe_data)}),
        ):
            for command in ("rollout", "eval"):
                extra = ["--samples-per-task", "1"] if command == "rollout" else []
                r = subprocess.run(
                    [sys.executable, "-m", "palaestra.cli", command, "--env", env, "--gateway", s.gw.url]
                    + ["--tasks", "2", "--env-args", json.dumps(args), "--quiet", *extra],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    env={**os.environ, "PALAESTRA_API_KEY": "k-env"},
                )
                assert r.returncode == 0, r.stdout + r.stderr
                if command == "rollout":
                    assert r.stdout.startswith("2 rollouts") and "completed 2" in r.stdout, r.stdout
                else:
                    assert "accuracy 0.000" in r.stdout, r.stdout
        sessions = {ex.headers.get("x-smg-routing-key") for ex in s.engine.exchanges}
        assert len(sessions) == 8  # 2 tasks x (rollout + eval) x 2 environments


@pytest.mark.slow
def test_swe_instances_from_a_real_package_are_generated_validated_and_solved_in_the_local_sandbox(
    tok, tmp_path, swe_real
):
    """`palaestra swe generate`'s path over inflection's sdist (its own pytest suite, run in the
    environment built offline from `palaestra swe fetch`'s wheels; the `swe_real` fixture): the
    instances it keeps are valid (validated as they are made), and an episode in the local sandbox
    has the environment on its PATH and is resolved by the reference fix."""
    from palaestra.environments.swe_agent.generate import PYTEST
    from palaestra.environments.swe_agent.instance import load_jsonl

    out, options = swe_real
    made = load_jsonl(out)
    assert made and all(i.test_cmd == PYTEST and "::" in i.FAIL_TO_PASS[0] for i in made)
    with backend_for("local") as local:
        env = SweAgentEnv(
            data=str(out), backend=local, max_turns=6, env_cache_dir=options.cache_dir,
            find_links=list(options.find_links), index=False,
        )  # fmt: skip
        instance = next(i for i in env.tasks(0) if i.bug_kind != "missing_case")
        fix, path = _fix_calls(instance)
        with Scripted(tok, tmp_path / "gw") as s:
            probe = call(
                "bash", command="python -c 'import pytest, sys; print(pytest.__version__, sys.prefix)'"
            )
            right, _, samples = s.play(env, instance, [probe, *fix, call("submit")])
            assert right.reward == 1.0 and right.metrics["resolved"] == 1.0, right.metrics
            masked, _ = s.split(samples[0])
            assert "9.1.1 /venv" in masked  # the instance's environment, in the agent's sandbox
