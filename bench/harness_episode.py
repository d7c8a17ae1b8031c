"""A long episode of a real harness (Claude Code or Codex) in the harness environment: the gateway's
cost per turn as the episode grows, and the engine's prefix-cache hit rate over it. One run, ratios.

    .venv/bin/python -m bench.harness_episode [--harness claude-code] [--turns 20] [--output-chars 1500]
        [--reasoning-chars 0] [--per-turn]

The harness binary runs unchanged in the local sandbox on a swe instance (environments/harness),
through its session's tunnel, against a gateway subprocess. A random model would not call tools,
so the engine in front of the gateway is `PrefillingScript`, a labelled TEST DOUBLE over the real
embedded engine: each call's output is scripted (a shell-tool call whose command prints
`--output-chars` characters of the repository's code, `--turns` times, then a final text), and the
real engine is made to prefill that call's prompt + output (`/generate`, `max_new_tokens: 0`), so
its prefix cache holds what it would hold had it sampled those tokens; the hit rate printed is the
real engine's `cached_tokens` over the prompt. With `--reasoning-chars N` each tool call opens with
N characters of reasoning (`<think>...</think>`, parsed by the preset's reasoning parser), which the
harness sends back (Codex as `reasoning` items): the turns then have reasoning in their history and
are bridged by the whole-history checks on the parent's rendering plus a short one
(`bridge._bridge_appended`), where without it they take the short rendering. Printed:

* prompt tokens first -> last turn; the gateway's CPU per turn (from the start of one engine call
  to the next: the answer streamed back through the gateway, the harness's tool, the next request
  rendered and bridged), mean of the first 4 tool turns vs the last 4, and its ratio (an append
  renders only what is new: the goal is <= 1.2x), beside the gateway's own
  `call_overhead_seconds` mean (streamed calls included: the engine's and the client's time left out);
* the engine's prefix-cache hit rate over the episode and on the last turn;
* per call, the share of the previous call's prompt the engine found in its prefix cache (goal:
  >= 0.95 on every bridged turn), and the lowest;
* that the episode bridged (forks) and what the harness sent that was recorded (ignored controls);
* with `--per-turn`, each tool turn's gateway CPU in order (a one-off such as a template probe on the
  first turn that needs it shows apart from the growth along the episode).
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench import common
from bench.gateway import cpu_seconds
from palaestra.engine.cli import engine_process
from palaestra.environments.harness.env import HarnessEnv
from palaestra.environments.swe_agent.generate import generate
from palaestra.gateway.cli import gateway_process
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.models import resolve_model
from palaestra.sandbox.local import LocalBackend
from tests.support.doubles import SubprocessBackendForTests
from tests.support.servers import ScriptedEngine, ThreadServer
from tests.support.sessions import rollouts

KEY = "bench"
ENV = {"PALAESTRA_API_KEY": KEY, "PALAESTRA_ADMIN_KEY": "bench-admin"}
SHELL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd")}


class PrefillingScript:
    """TEST DOUBLE of the model's choices over the real engine's prefill and prefix cache (module
    docstring): scripted output ids, the real engine prefilling prompt + output."""

    def __init__(
        self, tok, harness: str, engine_url: str, turns: int, output_chars: int, reasoning_chars: int = 0
    ):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.reasoning_chars = reasoning_chars
        self.tool, self.argument = SHELL[harness]
        self.engine = httpx.Client(base_url=engine_url, timeout=600, trust_env=False)
        self.turns, self.output_chars = turns, output_chars
        self.gateway_pid = 0
        self.tool_calls = 0
        self.rows: list[dict] = []  # per engine call: kind, prompt, cached, gateway CPU at its start

    def command(self, k: int) -> str:
        chunk = self.output_chars
        return (
            f"find . -name '*.py' | sort | xargs cat | head -c {chunk * (k + 1)} | tail -c {chunk}; "
            f"echo; echo 'turn {k} done'"
        )

    def reasoning(self, k: int) -> str:
        """Tool call `k`'s reasoning, as Qwen3 writes it ahead of its answer ('' without the option)."""
        if not self.reasoning_chars:
            return ""
        line = f"Step {k}: the next part of the code is read with the shell tool, then summarised. "
        body = (line * (self.reasoning_chars // len(line) + 1))[: self.reasoning_chars].strip()
        return f"<think>\n{body}\n</think>\n\n"

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        cpu = cpu_seconds(self.gateway_pid) if self.gateway_pid else 0.0
        if f'"name": "{self.tool}"' not in self.tok.decode(input_ids[:20000]):
            kind, text = "other", "ok"
        elif self.tool_calls < self.turns:
            kind = "tool"
            args = json.dumps({self.argument: self.command(self.tool_calls)})
            text = self.reasoning(self.tool_calls) + render_tool_call_text("hermes", self.tool, args)
            self.tool_calls += 1
        else:
            kind, text = "final", "The repository has been read."
        out = self.tok.encode(text, add_special_tokens=False) + [self.end]
        answer = self.engine.post(
            "/generate", json={"input_ids": input_ids + out, "sampling_params": {"max_new_tokens": 0}}
        )
        answer.raise_for_status()
        cached = answer.json()["meta_info"].get("cached_tokens", 0)
        self.rows.append(
            {"kind": kind, "prompt": len(input_ids), "cached": min(cached, len(input_ids)), "cpu": cpu}
        )
        return out


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--harness", default="claude-code", choices=sorted(SHELL))
    ap.add_argument("--model", default="tiny-qwen3", help="a preset with a real vocabulary (prompt lengths)")
    ap.add_argument("--turns", type=int, default=20, help="tool calls before the final answer")
    ap.add_argument("--output-chars", type=int, default=1500, help="characters each tool call prints")
    ap.add_argument(
        "--reasoning-chars",
        type=int,
        default=0,
        help="characters of reasoning ahead of each tool call (0: none; the module docstring)",
    )
    ap.add_argument(
        "--per-turn", action="store_true", help="also print each tool turn's gateway CPU (ms), in order"
    )
    args = ap.parse_args()
    if args.reasoning_chars < 0:
        ap.error(f"--reasoning-chars must be 0 or more; got {args.reasoning_chars}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as tmp:
        work = Path(tmp)
        data = work / "swe.jsonl"
        asyncio.run(
            generate(data, SubprocessBackendForTests(), per_kind=1, repos=["textkit"], tries_per_kind=4)
        )
        with engine_process(args.model, extra_args=["--num-threads", "1"]) as engine:
            script = PrefillingScript(
                tok, args.harness, engine.url, args.turns, args.output_chars, args.reasoning_chars
            )
            fake = ScriptedEngine(script, stop_ids={script.end})
            with (
                ThreadServer(fake.app()) as front,
                gateway_process(args.model, front.url, str(work / "spool"), env=ENV) as gw,
            ):
                script.gateway_pid = gw.pid
                env = HarnessEnv(
                    harness=args.harness,
                    data=str(data),
                    backend=LocalBackend(),
                    max_turns=args.turns + 20,
                    time_limit_s=3000,
                )
                started = time.perf_counter()
                result = rollouts(gw.url, KEY, env, [env.tasks(0)[0]]).results[0]
                wall = time.perf_counter() - started
                with httpx.Client(
                    timeout=60, trust_env=False, headers={"Authorization": f"Bearer {KEY}"}
                ) as c:
                    metrics = c.get(f"{gw.url}/metrics").text
                    traj = c.get(f"{gw.url}/sessions/{result.session_id}").json()
    rows = script.rows
    # a turn's gateway CPU: from the start of its engine call to the start of the next one
    per_turn = [(rows[i], rows[i + 1]["cpu"] - rows[i]["cpu"]) for i in range(len(rows) - 1)]
    tools = [cost for row, cost in per_turn if row["kind"] == "tool"]
    first, last = sum(tools[:4]) / max(len(tools[:4]), 1), sum(tools[-4:]) / max(len(tools[-4:]), 1)
    over_sum = metric(metrics, "palaestra_gateway_call_overhead_seconds_sum")
    over_n = metric(metrics, "palaestra_gateway_call_overhead_seconds_count")
    prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
    print(
        f"{args.harness} on {args.model}"
        + (f" (reasoning {args.reasoning_chars} chars a tool call)" if args.reasoning_chars else "")
        + f": {result.status}, {len(rows)} engine calls "
        f"({sum(r['kind'] == 'tool' for r in rows)} tool calls), {wall:.0f} s, "
        f"metrics harness/exit_code={result.metrics.get('harness/exit_code')} "
        f"failure/harness_exit={result.metrics.get('failure/harness_exit')} "
        f"failure/harness_timeout={result.metrics.get('failure/harness_timeout')}"
    )
    print(
        f"prompt {rows[0]['prompt']} -> {rows[-1]['prompt']} tokens; gateway CPU per tool turn "
        f"{first * 1e3:.1f} ms (first 4) -> {last * 1e3:.1f} ms (last 4) = {last / max(first, 1e-9):.2f}x; "
        + (
            f"gateway call overhead {over_sum / over_n * 1e3:.1f} ms (mean of {int(over_n)} calls)"
            if over_n
            else "call_overhead_seconds observed no call"
        )
    )
    if args.per_turn:
        print("gateway CPU per tool turn (ms): " + " ".join(f"{cost * 1e3:.1f}" for cost in tools))
    print(
        f"engine prefix-cache hit rate: {cached / max(prompt, 1):.3f} over the episode, "
        f"{rows[-1]['cached'] / max(rows[-1]['prompt'], 1):.3f} on the last call"
    )
    # each call's reuse of what the previous call sent: cached tokens / the previous prompt's tokens
    reuse = [rows[t]["cached"] / max(rows[t - 1]["prompt"], 1) for t in range(1, len(rows))]
    if reuse:
        worst = min(range(len(reuse)), key=reuse.__getitem__)
        print("prefix reuse per call (cached / previous prompt): " + " ".join(f"{r:.2f}" for r in reuse))
        print(
            f"lowest reuse {reuse[worst]:.3f} at call {worst + 2} (goal >= 0.95 on every bridged turn: "
            f"{'met' if reuse[worst] >= 0.95 else 'NOT met'})"
        )
    print(
        f"forks: {len(traj['forks'])} {dict(Counter(f.get('reason') for f in traj['forks']))}; refused: {traj['refused']}; ignored controls: {traj['ignored_controls']}"
    )


if __name__ == "__main__":
    main()
